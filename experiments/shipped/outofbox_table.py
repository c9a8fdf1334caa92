"""The README's out-of-the-box table, from the two runs of ``outofbox.py``:

    python experiments/shipped/outofbox_table.py

``outofbox-forward.jsonl`` (the forward's GPU time, the rule and the rule before the fit)
beside ``outofbox.jsonl`` (one run: the eager forward and forward plus backward of ours and
fla's). Ratios compare rows of the same run.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RULE, BEFORE = "out of the box", "legacy rule"


def rows(name: str) -> dict[tuple, dict]:
    found = {}
    for line in (HERE / name).read_text().splitlines():
        r = json.loads(line)
        if r["kind"] == "time":
            found[r["b"], r["h"], r["s"], r["dk"], r["dv"], r["mode"]] = r
    return found


def main() -> None:
    gpu, eager = rows("outofbox-forward.jsonl"), rows("outofbox.jsonl")
    print(
        "| shape | DK/DV | rule's config | fwd GPU ms | before the fit | fwd eager ms | fla fwd | fwd vs fla "
        "| fwd+bwd ms | fla fwd+bwd | vs fla |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for b, h, s, dk, dv, mode in eager:
        if mode != RULE:
            continue
        key = (b, h, s, dk, dv)
        ours, fla, fast, before = (
            eager[(*key, RULE)],
            eager[(*key, "fla")],
            gpu[(*key, RULE)],
            gpu[(*key, BEFORE)],
        )
        cells = [
            f"{b}x{h}x{s}",
            f"{dk}/{dv}",
            ours["config"],
            f"{fast['fwd_ms']:.4f}",
            f"{before['fwd_ms']:.4f}",
            f"{ours['fwd_ms']:.4f}",
            f"{fla['fwd_ms']:.4f}",
            f"{fla['fwd_ms'] / ours['fwd_ms']:.2f}x",
            f"{ours['fwdbwd_ms']:.3f}",
            f"{fla['fwdbwd_ms']:.3f}",
            f"{fla['fwdbwd_ms'] / ours['fwdbwd_ms']:.2f}x",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
