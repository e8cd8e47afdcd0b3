"""What a student is worth: acceptance against the teacher on held-out continuations and text (Σmin(p,q), greedy
agreement), its measured cost ratio c and the speedup Leviathan et al.'s formula predicts from both (`describe`)."""

from __future__ import annotations

import sys

import torch

from eval.theory import best_gamma
from models.pair import Pair


@torch.inference_mode()
def acceptance(draft, target, items: list[dict], vocab: int, device, teacher_cache: dict | None = None) -> dict:
    """Teacher-forced agreement of draft q and target p on positions item["start"]: of each sequence.

    Returns token-weighted means of Σmin(p,q) (the per-token acceptance rate of exact sampling verification) and of
    1[argmax q = argmax p] (greedy verification), plus the per-sequence Σmin means. `teacher_cache` (dict) keeps the
    target's probabilities between calls, so repeated checks during training do not rerun the target.
    """
    sums, agrees, per_seq, n = 0.0, 0.0, [], 0
    for i, it in enumerate(items):
        ids = it["ids"].long().unsqueeze(0).to(device)
        s = int(it["start"])
        if teacher_cache is not None and i in teacher_cache:
            p = teacher_cache[i].float()
        else:
            p = torch.softmax(target(ids).logits[0, s - 1 : -1, :vocab].float(), -1)
            if teacher_cache is not None:
                teacher_cache[i] = p.to(torch.bfloat16)
        q = torch.softmax(draft(ids).logits[0, s - 1 : -1, :vocab].float(), -1)
        m = torch.minimum(p, q).sum(-1)
        sums += m.sum().item()
        agrees += (p.argmax(-1) == q.argmax(-1)).float().sum().item()
        per_seq.append(m.mean().item())
        n += m.numel()
    return {"sum_min": sums / max(n, 1), "greedy_agree": agrees / max(n, 1), "tokens": n, "per_seq_sum_min": per_seq}


def measure_cost_ratio(draft, target, vocab: int, ids: torch.Tensor, repeats: int = 25) -> dict:
    """c = draft step ÷ target step (key `c`, and both in ms) after the context `ids` (1, L), timed as decode calls
    the models (models.profiling.step_ratio through models.lm.LM: the cost profile's own probe)."""
    from models.lm import LM
    from models.profiling import step_ratio

    return step_ratio(LM(draft, vocab), LM(target, vocab), ids[0].tolist(), repeats=repeats)


def leviathan_speedup(alpha: float, cost_ratio: float, max_gamma: int = 32) -> dict:
    """Leviathan et al. (2023) Thm 3.8 via eval.theory: the best constant γ ≥ 1 and its speedup; γ = 0 (speedup 1)
    when no γ beats target-only decoding."""
    gamma, factor = best_gamma(alpha, cost_ratio, max_gamma)
    return {"speedup": factor, "gamma": gamma} if factor > 1.0 else {"speedup": 1.0, "gamma": 0}


def describe(draft, target, pair: Pair, heldout, heldout_text, cost_ids, measure_cost: bool, cache=None) -> dict:
    cont = acceptance(draft, target, heldout, pair.vocab_size, pair.device,
                      None if cache is None else cache.setdefault("cont", {}))
    text = acceptance(draft, target, heldout_text, pair.vocab_size, pair.device,
                      None if cache is None else cache.setdefault("text", {}))
    row = {"heldout_sum_min": cont["sum_min"], "heldout_greedy_agree": cont["greedy_agree"],
           "heldout_text_sum_min": text["sum_min"], "heldout_tokens": cont["tokens"]}
    if measure_cost:
        row.update(measure_cost_ratio(draft, target, pair.vocab_size, cost_ids))
        row["speedup_sampling"] = leviathan_speedup(row["heldout_sum_min"], row["c"])
        row["speedup_greedy"] = leviathan_speedup(row["heldout_greedy_agree"], row["c"])
    return row


def print_table(rows: dict[str, dict]) -> None:
    cols = [("heldout_sum_min", "Σmin(p,q) cont."), ("heldout_greedy_agree", "greedy agree"),
            ("heldout_text_sum_min", "Σmin(p,q) text"), ("c", "cost ratio c")]
    head = f"{'':>10} " + " ".join(f"{name:>16}" for _, name in cols) + f" {'speedup (γ) greedy/sampling':>30}"
    print(head)
    for label, r in rows.items():
        vals = " ".join(f"{r[k]:16.3f}" if k in r else f"{'-':>16}" for k, _ in cols)
        sp = (f"{r['speedup_greedy']['speedup']:.2f} ({r['speedup_greedy']['gamma']}) / "
              f"{r['speedup_sampling']['speedup']:.2f} ({r['speedup_sampling']['gamma']})") if "c" in r else "-"
        print(f"{label:>10} {vals} {sp:>30}")
    sys.stdout.flush()
