"""Run by .ci/run with the fresh virtual environment's python, from outside the checkout:
the product imports from the installed wheel, the files it loads at run time are in it,
and tuning on first use would start the installed tuner, not a checkout's."""

import sys
import sysconfig
from pathlib import Path

import kernel
import kernel.ops
import tuner
from kernel import KernelConfig, Problem
from kernel.ops import autotune, tables
from tuner import fit_data, latency

site = Path(sysconfig.get_path("purelib")).resolve()
checkout = Path(sys.argv[1]).resolve()
for package in (kernel, tuner):
    where = Path(package.__file__).resolve()
    assert where.is_relative_to(site), f"{package.__name__} from {where}, not the wheel in {site}"

model = latency.latency_model()  # the shipped model, read as tuning reads it
assert latency.model_path().resolve().is_relative_to(site) and model.key, latency.model_path()
fitted_to = [fit_data.path(name) for name in {*fit_data.MODEL_GRIDS, fit_data.RULE_GRID}]
missing = [str(p) for p in fitted_to if not p.is_file()]
assert not missing, f"the wheel lacks the grids the model and the rule are fitted to: {missing}"
assert fit_data.rule_scores([fit_data.path(fit_data.RULE_GRID)]), "the rule scored on its grid"
for table in sorted(tables.SHIPPED.glob("*.json")):  # the shipped dispatch tables
    kernel.ops.load_dispatch(table, allow_mismatch=True)

cmd, env = autotune.child_command(Problem(1, 2, 256, 64, 64), Path("table.json"), Path("studies"))
assert cmd[:3] == [sys.executable, "-m", "tuner"], cmd
assert str(checkout) not in env.get("PYTHONPATH", ""), env.get("PYTHONPATH")
assert KernelConfig().to_dict()
print(f"installed: kernel and tuner from {site}; the latency model {model.key}; {len(fitted_to)} grids")
