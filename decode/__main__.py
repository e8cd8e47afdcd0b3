"""`python -m decode pair=NAME dataset=NAME split=S limit=N max_new_tokens=M temperature=T policies=[...] out_dir=DIR`.

Runs target-only decoding once and every listed stop policy on the same prompts (see decode/runner.py), writes
DIR/summary.json, a Markdown table, per-prompt JSONL and plots. `mode=tune` picks thresholds on validation first.
"""

from utils.cli import hydra_entry


@hydra_entry("decode")
def main(cfg):
    from decode.runner import main as run

    run(cfg)


if __name__ == "__main__":
    main()
