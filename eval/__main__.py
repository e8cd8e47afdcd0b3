"""`python -m eval ckpt=PATH [split=test] [traces=DIR] [out_dir=DIR] [trace_root=DIR]`: a stop head as a classifier.

    python -m eval ckpt=logs/train/runs/<time>/checkpoints/best.ckpt
    python -m eval 'ckpt=[runA/checkpoints/best.ckpt,runB/checkpoints/best.ckpt]'   # one table, overlaid curves

For each checkpoint, on the traces it was trained from (its training run's pair × dataset × trace × `split`, found
through the run's saved Hydra config, or `traces=DIR`):
AUROC, AP, F1/precision/recall/confusion at the checkpoint's threshold and at the best-F1 threshold (eval.metrics),
ECE (torchmetrics BinaryCalibrationError, 15 equal-width bins) with a reliability diagram (sklearn
calibration_curve), AUROC per bucket of position in the draft round and in the continuation, and the best static
speculation length's F1 (DISCO App. D). For a SPRINTER head also the Theorem 1/2 predictions from its measured
FPR/TPR (eval.theory). Writes report.json, report.md and PNGs (roc, pr, reliability, per_position_auroc) to out_dir
(default: the Hydra run dir logs/eval/runs/<time>; also per_continuation_position_auroc.png) and, with logger=wandb, the same to an offline W&B run
(default logger=none). Labels are the checkpoint's own scheme, binarised at 0.5.
"""

from omegaconf import DictConfig

from utils.cli import hydra_entry


@hydra_entry("eval")
def main(cfg: DictConfig) -> None:
    from eval.classifier import run

    run(cfg)


if __name__ == "__main__":
    main()
