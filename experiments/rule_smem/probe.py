"""The shared memory the rule's forward configs declare on each architecture, compiled
here (no GPU): the rule before the fit (``legacy_config``) against the rule now, and the
rule's estimate (``kernel.rule.smem_bytes``) beside what ptxas and the lowering report.

    PYTHONPATH=. python3 experiments/rule_smem/probe.py > experiments/rule_smem/probe.jsonl
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "h200" / "shipped"))

from rule import legacy_config  # noqa: E402

from kernel.arch import ARCHS  # noqa: E402
from kernel.builder import precompile  # noqa: E402
from kernel.config import Problem, model_call  # noqa: E402
from kernel.probe import Resources  # noqa: E402
from kernel.rule import default_config, smem_bytes  # noqa: E402

HEADS = [(64, 64), (128, 128), (128, 256), (256, 256)]


def main() -> None:
    for arch in ("sm_80", "sm_86", "sm_90a"):
        jobs, rules = [], []
        for dk, dv in HEADS:
            p = Problem(8, 16, 4096, dk, dv, "bfloat16")
            for rule, config in (
                ("before", legacy_config(p, ARCHS[arch].sms)),
                ("now", default_config(p, arch)),
            ):
                jobs.append((p, config, model_call(p)))
                rules.append(rule)
        for rule, (p, config, _), res in zip(rules, jobs, precompile(jobs, arch=arch, workers=2)):
            row = {"arch": arch, "dk": p.dk, "dv": p.dv, "rule": rule, "config": config.label}
            row["limit"] = ARCHS[arch].smem_per_block
            row["estimate"] = smem_bytes(p, config)
            if isinstance(res, Resources):
                row |= {"smem_bytes": res.smem_bytes, "fits": res.fits_smem, "spill_bytes": res.spill_bytes}
            else:
                row["failure"] = res.to_dict()
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
