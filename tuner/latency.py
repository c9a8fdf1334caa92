"""A latency model learned from GPU timings: from a config, its problem and the probe's
resources, the kernel's predicted time as a ratio to the HBM floor, with an interval.

The model is a small gradient-boosted regression tree ensemble, fitted by
``tuner.latency_fit`` (``python -m tuner model fit``) and shipped as plain JSON
(``latency_model.json`` beside this module, no pickle); predicting needs only the standard
library. It is calibrated for the architecture it was trained on. For any other one the
prediction is labelled uncalibrated and comes from the analytic part alone
(``tuner.occupancy.analytic_ratio``: how full the blocks' waves keep the SMs), which ranks grids, not
pipelines.
"""

import functools
import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kernel.config import KernelConfig, Problem
from kernel.files import replacing
from kernel.trial_schema import NO_MODEL, OUTSIDE, PREDICTED, UNCALIBRATED
from tuner.occupancy import BlockResources, analytic_ratio, blocks_per_sm, floor_bytes, grid

MODEL_FILE = Path(__file__).with_name("latency_model.json")
MODEL_VARIABLE = "DECAY_TUNER_LATENCY_MODEL"  # a model file of the user's, fitted to their GPU
MODEL_FORMAT = "decay-tuner-latency-model"
# The copy rate of the GPU the shipped model was fitted on, as the bench measures it: the
# floor its timings are divided by. evidence: docs/evidence.md#model-bandwidth
MODEL_BANDWIDTH = 4.22e12

FEATURES = (
    "log2 blocks per SM slot",
    "waves",
    "last wave fill",
    "blocks per SM",
    "stages",
    "log2 block_dv",
    "log2 DK",
    "log2 DV",
    "dk+dv sweep",
    "log2 segments",
    "log2 tokens per block",
    "chunk",
    "registers",
    "smem KiB",
    "threads",
    "log2 B*H",
    "log2 S",
    "per-token gate",  # 0: a constant decay per head; 1: the gated kernel's (Problem.gate, kernel.gated)
)


def features(
    problem: Problem,
    config: KernelConfig,
    sweep: str,
    resources: BlockResources,
    arch: str,
    sms: int | None = None,
) -> list[float]:
    """The model's inputs, in the order of ``FEATURES``, on a GPU of ``sms`` SMs (default:
    the arch's reference GPU's)."""
    p, c = problem, config
    blocks, slots, waves = grid(p, c, resources, arch, sms)
    last = blocks - (waves - 1) * slots
    return [
        math.log2(blocks / slots),
        waves,
        last / slots,
        blocks_per_sm(resources, arch),
        c.num_stages,
        math.log2(c.block_dv),
        math.log2(p.dk),
        math.log2(p.dv),
        float(sweep == "dkdv"),
        math.log2(c.segment_count(p.seqlen)),
        math.log2(c.segment_length(p.seqlen)),
        c.chunk,
        resources.registers,
        resources.smem_bytes / 1024,
        resources.threads,
        math.log2(p.batch * p.heads),
        math.log2(p.seqlen),
        float(p.gate == "token"),
    ]


@dataclass(frozen=True)
class Prediction:
    """A predicted time, never a measurement: the ratio to the HBM floor and its interval
    (the held-out residuals' 10th to 90th percentile); ``calibrated`` False where the
    model was not trained on ``arch`` (then the analytic part alone, with no interval)."""

    ratio: float
    low: float
    high: float
    calibrated: bool
    arch: str
    floor_ms: float | None  # at the calibrating GPU's bandwidth; None uncalibrated
    model: str = ""  # the GPU the model was calibrated on
    covered: bool = True  # the config's knobs and head sizes are among those it was fitted to

    @property
    def ms(self) -> float | None:
        return None if self.floor_ms is None else self.ratio * self.floor_ms

    def record(self) -> dict[str, Any]:
        """The prediction as a trial records it (``kernel.trial_schema.PREDICTED``), less
        what it lacks (uncalibrated: the interval and the time in ms)."""
        if self.calibrated:
            by = f"latency model of {self.model}"
        elif self.model:
            by = f"{UNCALIBRATED}: uncalibrated for {self.arch}"
        else:
            by = f"{UNCALIBRATED}: {NO_MODEL}"
        by += "" if self.covered else OUTSIDE
        values = zip(PREDICTED, (self.ratio, self.low, self.high, self.ms, by))
        return {key: value for key, value in values if value is not None and value == value}  # not NaN


@dataclass(frozen=True)
class LatencyModel:
    """A fitted ensemble: ``trees`` of nodes ``[feature, threshold, left, right, value]``
    (a leaf has feature -1), summed with ``baseline``, predict log(time / floor)."""

    arch: str
    gpu: str
    bandwidth: float  # bytes/s of the calibrating GPU, for the floor in ms
    baseline: float
    trees: tuple[tuple[tuple[float, ...], ...], ...]
    interval: tuple[float, float]  # log residual quantiles on held-out shapes
    trained: dict[str, Any]  # provenance: data, held-out shapes and their accuracy
    domain: dict[str, list]  # each knob's values, the [DK, DV] pairs and the gates it was fitted to

    @functools.cached_property
    def key(self) -> str:
        """The model's identity (its numbers, not its provenance): a compile-only study's
        ranks compare only under one (``tuner.studies.hold``)."""
        numbers = (self.arch, self.gpu, self.bandwidth, self.baseline, self.trees, self.interval, self.domain)
        return hashlib.sha256(repr(numbers).encode()).hexdigest()[:12]

    def covers(self, problem: Problem, config: KernelConfig) -> bool:
        """Whether ``config``'s knobs, the head sizes and the decay's kind (``Problem.gate``)
        are all among those fitted to: a prediction elsewhere extrapolates (a tree knows
        nothing of a chunk it never saw). A model that lists no gates was fitted to constant
        decays."""
        knobs = config.to_dict().items()
        return (
            all(v in self.domain[k] for k, v in knobs)
            and [problem.dk, problem.dv] in self.domain["dk_dv"]
            and float(problem.gate == "token") in self.domain.get("gate", [0.0])
        )

    @classmethod
    def load(cls, path: Path = MODEL_FILE) -> "LatencyModel":
        try:
            data = json.loads(Path(path).read_text())
            if (
                not isinstance(data, dict)
                or data.get("format") != MODEL_FORMAT
                or not isinstance(data.get("features"), list)
                or data["features"] != list(FEATURES[: len(data["features"])])
            ):  # a model of fewer features (an older file) predicts the same: its trees never read the rest
                raise ValueError(f"not a latency model of these features ({MODEL_FORMAT})")
            model = cls(
                data["arch"],
                data["gpu"],
                float(data["bandwidth"]),
                float(data["baseline"]),
                tuple(tuple(tuple(float(x) for x in node) for node in tree) for tree in data["trees"]),
                tuple(float(q) for q in data["interval"]),
                data["trained"],
                data["domain"],
            )
            model.check()
            if any(node[0] >= len(data["features"]) for tree in model.trees for node in tree):
                raise ValueError("a tree node reads a feature the file does not list")
            return model
        except KeyError as exc:
            raise ValueError(f"{path}: cannot read the latency model: no field {exc}") from None
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            raise ValueError(f"{path}: cannot read the latency model: {exc}") from None

    def check(self) -> None:
        """``ValueError`` unless every field is what ``predict`` can use: a positive
        bandwidth, a finite baseline, an interval of two, a domain that lists each knob's
        values and the [DK, DV] pairs, trees whose nodes each hold five finite numbers and
        point at features that exist and at nodes further down."""
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)) or len(self.interval) != 2:
            raise ValueError(f"bandwidth {self.bandwidth} or interval {self.interval} out of range")
        if not all(math.isfinite(x) for x in (self.baseline, *self.interval)):
            raise ValueError(f"baseline {self.baseline} or interval {self.interval} not finite")
        named = {*KernelConfig().to_dict(), "dk_dv"}
        if not isinstance(self.domain, dict) or not named <= set(self.domain) <= {*named, "gate"}:
            raise ValueError("its domain does not name every knob and the head sizes")
        if not all(isinstance(values, list) for values in self.domain.values()) or not all(
            isinstance(pair, list) and len(pair) == 2 for pair in self.domain["dk_dv"]
        ):
            raise ValueError("its domain does not list each knob's values and the [DK, DV] pairs")
        if not self.trees:
            raise ValueError("no trees")
        for tree in self.trees:
            if not tree:
                raise ValueError("an empty tree")
            for at, node in enumerate(tree):
                if len(node) != 5 or not all(math.isfinite(x) for x in node):
                    raise ValueError(f"a tree node {list(node)[:5]}: not 5 finite numbers")
                feature, _, left, right, _ = node
                children = at < min(left, right) and max(left, right) < len(tree)  # down the tree only
                if feature >= 0 and not (feature < len(FEATURES) and children):
                    raise ValueError(f"a tree node {list(node)} points outside its features or tree")

    def save(self, path: Path) -> None:
        """Write the model atomically, one tree a line."""
        head = {
            "format": MODEL_FORMAT,
            "features": list(FEATURES),
            "arch": self.arch,
            "gpu": self.gpu,
            "bandwidth": self.bandwidth,
            "baseline": self.baseline,
            "interval": list(self.interval),
            "trained": self.trained,
            "domain": self.domain,
        }
        trees = ",\n".join(json.dumps([list(node) for node in tree]) for tree in self.trees)
        with replacing(Path(path)) as tmp:
            text = json.dumps(head, indent=1, allow_nan=False)  # plain JSON: no NaN
            tmp.write_text(text[:-2] + ',\n "trees": [\n' + trees + "\n]}\n")

    def log_ratio(self, x: list[float]) -> float:
        total = self.baseline
        for tree in self.trees:
            node = tree[0]
            while node[0] >= 0:
                node = tree[int(node[2] if x[int(node[0])] <= node[1] else node[3])]
            total += node[4]
        return total

    def predict(
        self,
        problem: Problem,
        config: KernelConfig,
        resources: BlockResources,
        *,
        arch: str,
        sweep: str = "forward",
        sms: int | None = None,
    ) -> Prediction:
        """The prediction on ``arch``, on a GPU of ``sms`` SMs where known (the GPU at hand;
        default: the arch's reference GPU's)."""
        if arch != self.arch:
            ratio = analytic_ratio(problem, config, resources, arch, sms)
            return Prediction(ratio, math.nan, math.nan, False, arch, None, self.gpu)
        log = self.log_ratio(features(problem, config, sweep, resources, arch, sms))
        floor_ms = floor_bytes(problem, sweep) / self.bandwidth * 1e3
        low, high = (math.exp(log + q) for q in self.interval)
        covered = self.covers(problem, config)
        return Prediction(math.exp(log), low, high, True, arch, floor_ms, self.gpu, covered)


def model_path() -> Path:
    """The model in use: the file ``DECAY_TUNER_LATENCY_MODEL`` names, else the shipped one."""
    return Path(os.environ.get(MODEL_VARIABLE) or MODEL_FILE)


def latency_model() -> LatencyModel:
    """The model in use (``model_path``), read once per file. A file that cannot be read is
    warned about once, by name, and every prediction is then the analytic part alone."""
    return _load(model_path())


# No trees and no architecture: predicts by the analytic part alone, saying there is no model.
ANALYTIC_ONLY = LatencyModel("", "", MODEL_BANDWIDTH, 0.0, (), (math.nan, math.nan), {}, {})


@functools.cache
def _load(path: Path) -> LatencyModel:
    try:
        return LatencyModel.load(path)
    except ValueError as exc:
        print(f"warning: {exc}; predictions are the analytic part alone", file=sys.stderr)
        return ANALYTIC_ONLY
