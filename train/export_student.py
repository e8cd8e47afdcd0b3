"""Store a train.distill student file in another dtype, metadata kept and the cast recorded.

    python -m train.export_student src=logs/distill/<run>/student.safetensors out=models/weights/NAME.safetensors \
        [dtype=bfloat16]

A run trained in float32 (a CPU without bf16, or `pair.dtype=float32` on a GPU) writes float32 tensors; the shipped
draft is stored in bf16, half the bytes, as every pair loads the student in its own dtype anyway
(`models.student.load_student` casts). The file's metadata gains `stored_dtype` and `stored_from` (the source's sha256),
so the shipped file names the exact training output it came from.
"""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import DictConfig

from models.student import read_student_file, write_student_file
from utils.cli import UserError, hydra_entry
from utils.files import sha256_file


def export_student(src: Path, out: Path, dtype: str = "bfloat16") -> dict:
    """Write `src`'s tensors to `out` in `dtype`; returns the new metadata."""
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise UserError(f"dtype={dtype} is not a torch floating dtype; use bfloat16, float16 or float32")
    if not src.is_file() or out.suffix != ".safetensors":
        raise UserError(f"src={src} must be a student file and out={out} must end in .safetensors")
    info, tensors = read_student_file(src)
    info.update(stored_dtype=dtype, stored_from={"file": src.name, "sha256": sha256_file(src)})
    write_student_file(out, {k: v.to(torch_dtype).contiguous() for k, v in tensors.items()}, info)
    return info


@hydra_entry("export_student")
def main(cfg: DictConfig) -> None:
    out = Path(str(cfg.out))
    info = export_student(Path(str(cfg.src)), out, str(cfg.dtype))
    print(f"{cfg.src} -> {out} ({info['stored_dtype']}, {out.stat().st_size / 2**20:.1f} MiB, step {info.get('step')})")


if __name__ == "__main__":
    main()
