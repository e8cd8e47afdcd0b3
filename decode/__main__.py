"""`python -m decode pair=NAME dataset=NAME split=S limit=N max_new_tokens=M temperature=T policies=[...] out_dir=DIR`.

Runs target-only decoding once and every listed stop policy on the same prompts (decode/runner.py composes
decode/run.py, tune.py and report.py), writes DIR/summary.json, a Markdown table, per-prompt JSONL and plots.
`mode=tune` picks thresholds on validation first. `logger=wandb` also logs them to an offline W&B run under DIR
(decode/wandb_log.py).
"""

from utils.cli import hydra_entry, output_dir


@hydra_entry("decode", open_dicts=("policy", "drafter"))  # policy.<name>.<param>=V for a yaml read lazily
def main(cfg):
    from decode import wandb_log
    from decode.runner import main as run

    with wandb_log.session(cfg, output_dir(cfg.get("out_dir")), "decode"):  # logger=wandb: one run per job
        run(cfg)


if __name__ == "__main__":
    main()
