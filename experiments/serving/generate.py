"""Issue 52, item 6: a generation loop over fla's RetNet served from our state pool, judged
by its logits against an fp32 run beside fla's own generation path, and its decode
tokens per second beside fla's.

The model: fla's ``RetNetForCausalLM`` (4 layers, hidden 1024, 8 heads, DK = DV = 128 with
``expand_k = expand_v = 1``, vocab 32,000), random weights of one seed; fla's bf16 path and
ours share one bf16 copy of the weights, the reference is the same weights in fp32.

Our engine keeps each layer's states in a pool ``[slots, H, DK, DV]`` fp32 and replaces
only the attention of each ``MultiScaleRetention`` (``pooled_retention``: fla's projections,
feature map, rotary embedding at each request's own positions, then our op, then fla's
gated norm and output projection); the rest of fla's blocks (norms, MLP, embeddings, head)
run unchanged. A prefill is one packed ``decay_attention(..., cu_seqlens=, pool=, slots=,
from_pool=)`` per layer; a decode step is one ``decay_decode`` per layer on the running
batch; requests that join while others decode go in one mixed call (``decodes=`` the
running ones, first).

1. ``check`` (a child process): 6 requests of 1 to 700 prompt tokens prefilled together
   into a pool whose rows start NaN; 16 decode steps; one request stops after 3 steps and
   its slot is handed to one of 3 new requests (3 to 333 tokens) that join at step 5 in a
   mixed call. Every path is fed the same tokens: the fp32 reference's greedy picks (fla's
   fp32 model, per request, on its exact recurrent kernel: ``mode = fused_recurrent``, no
   TF32). fla's bf16 path runs per request with its own cache (``past_key_values``), as
   ``generate`` calls the model. At every (request, step), prefill's last token and each
   decode: the relative L2 of the logits, ours-bf16 vs fp32 and fla-bf16 vs fp32. Passes
   when ours is within ``RATIO`` x fla's at the max and at the median over all those
   points, every logit is finite, and the pool rows no request used are still NaN.
2. ``speed`` (a child process): 64 requests of 256 tokens, prefilled, then ``TIMED``
   decode steps (greedy, next tokens fed back on the GPU, no host read), after ``WARM``,
   ``ROUNDS`` alternating rounds, ``torch.cuda.synchronize`` around each round: fla's
   batched path (its cache; as shipped its layers rebuild their rotary tables as the
   position grows, so also a copy whose tables are made once, ahead), ours eager, and ours
   as one captured CUDA graph per step. Decode tokens per second = 64 x TIMED / seconds.

    source .gpu/setup.sh && python3 experiments/serving/generate.py [--out FILE]

Writes JSON lines to FILE (default ``$OUT/serving_model.jsonl``, else beside this file)
and prints a table. Needs flash-linear-attention 0.6.0 and transformers (the GPU bundle
and the device's own transformers, as ``experiments/model/`` ran).
"""

import argparse
import copy
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent

HIDDEN, LAYERS, HEADS, VOCAB = 1024, 4, 8, 32000  # DK = DV = HIDDEN / HEADS = 128
MAX_POS = 4096  # our rotary table's length, made once (every position here stays below it)
SEED = 0
DEVICE = "cuda"

# The check's schedule: (prompt length, start step, decode steps) per request.
STEPS, JOIN, RETIRE_AFTER = 16, 5, 3
WAVE1 = [1, 40, 64, 65, 190, 700]  # request 1 (40 tokens) stops after RETIRE_AFTER steps
WAVE2 = [3, 129, 333]  # join at step JOIN; the first takes request 1's slot
POOL_SLOTS = 16
RATIO = 1.5  # ours may be this many times fla's distance from fp32, at the max and the median

# The throughput run.
BATCH, PROMPT, WARM, TIMED, ROUNDS = 64, 256, 4, 64, 3
CHECK_TIMEOUT_S, SPEED_TIMEOUT_S = 270, 180


def log(message: str, _start: float = time.perf_counter()) -> None:
    """Progress on stderr, with the seconds since the process started."""
    print(f"[{time.perf_counter() - _start:6.1f} s] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------
# The model and our serving path


def build_model(dtype: Any):
    """fla's RetNet of the sizes above, random weights of ``SEED``, on the GPU, eval mode."""
    import torch
    from fla.models import RetNetConfig, RetNetForCausalLM

    torch.manual_seed(SEED)
    config = RetNetConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_heads=HEADS,
        expand_k=1.0,
        expand_v=1.0,
        vocab_size=VOCAB,
        use_cache=True,
    )
    return RetNetForCausalLM(config).to(DEVICE, dtype).eval()


@dataclass
class Step:
    """What one engine call tells every layer. ``cu_seqlens`` None: a decode step, the
    input ``[N, 1]``; else packed sequences ``[1, T]`` whose first ``decodes`` have one
    token each and go on from their slots (the rest start from zero where ``from_pool``
    is false)."""

    offsets: Any  # int32 [N]: the position of each sequence's first token here
    slots: Any  # int32 [N]: its pool row
    cu_seqlens: Any = None  # int32 [N + 1]
    from_pool: Any = None  # bool [N]
    decodes: int = 0


class Engine:
    """Per-layer pools of states and the model's retention layers served from them while
    a ``Step`` is set; with none set the layers run fla's own forward."""

    def __init__(self, model: Any, slots: int) -> None:
        import torch

        from kernel.ops import decay_attention, decay_decode

        self.model = model
        self.attention, self.decode = decay_attention, decay_decode
        self.step: Step | None = None
        attns = [layer.attn for layer in model.model.layers]
        a = attns[0]
        # NaN: a row read before anything was written to it poisons the logits.
        self.pools = [
            torch.full((slots, a.num_heads, a.head_k_dim, a.head_v_dim), float("nan"), device=DEVICE)
            for _ in attns
        ]
        # RetNet's decays, as fla's chunk_retention and fused_recurrent_retention make them.
        self.decays = 1 - 2.0 ** (-5.0 - torch.arange(a.num_heads, dtype=torch.float32, device=DEVICE))
        for attn in attns:
            self._serve(attn)

    def _serve(self, attn: Any) -> None:
        if attn.use_short_conv or attn.num_kv_groups > 1:
            raise ValueError("the engine serves RetNet layers without short convolutions or grouped keys")
        original = type(attn).forward

        def forward(hidden_states, attention_mask=None, past_key_values=None, use_cache=False,
                    output_attentions=False, **kwargs):  # fmt: skip
            if self.step is None:
                return original(
                    attn,
                    hidden_states,
                    attention_mask,
                    past_key_values,
                    use_cache,
                    output_attentions,
                    **kwargs,
                )
            return self.retention(attn, hidden_states, self.step), None, past_key_values

        attn.forward = forward

    def retention(self, attn: Any, x: Any, step: Step) -> Any:
        """``MultiScaleRetention.forward`` (fla 0.6.0) with its recurrent state in the pool:
        x ``[N, 1, hidden]`` (decode) or ``[1, T, hidden]`` (packed) -> ``[..., hidden]``."""
        q = attn.q_proj(x).unflatten(-1, (-1, attn.head_k_dim))
        k = attn.k_proj(x).unflatten(-1, (-1, attn.head_k_dim))
        v = attn.v_proj(x).unflatten(-1, (-1, attn.head_v_dim))
        if attn.feature_map_fn is not None:
            q, k = map(attn.feature_map_fn, (q, k))
        # Tensor offsets: each sequence's own positions (packed: from its first token).
        q, k = attn.rotary(q, k, seqlen_offset=step.offsets, max_seqlen=MAX_POS, cu_seqlens=step.cu_seqlens)
        pool = self.pools[attn.layer_idx]
        if step.cu_seqlens is None:
            o = self.decode(q, k, v, self.decays, pool=pool, slots=step.slots)
        else:
            o, _ = self.attention(
                q, k, v, self.decays, cu_seqlens=step.cu_seqlens, pool=pool, slots=step.slots,
                from_pool=step.from_pool, decodes=step.decodes,
            )  # fmt: skip
        if attn.use_output_gate:
            g = attn.g_proj(x)
            if attn.fuse_norm_and_gate:
                o = attn.g_norm_swish_gate(o, g.unflatten(-1, (-1, attn.head_v_dim))).flatten(-2)
            else:
                o = attn.g_norm(o).flatten(-2) * attn.gate_fn(g)
        else:
            o = attn.g_norm(o).flatten(-2)
        return attn.o_proj(o)

    def logits(self, ids: Any, step: Step, last: Any = None) -> Any:
        """The logits ``[N, V]`` of each sequence's last token: ids ``[N, 1]`` (decode) or
        ``[1, T]`` with ``last`` the packed index of each sequence's last token."""
        self.step = step
        try:
            h = self.model.model(input_ids=ids, use_cache=False)[0]
        finally:
            self.step = None
        h = h[:, -1] if last is None else h[0, last]
        return self.model.lm_head(h)


# ---------------------------------------------------------------------------------------
# 1. The check


@dataclass
class Request:
    rid: int
    prompt: Any  # int64 [L] on the GPU
    start: int  # the engine step of its prefill
    steps: int  # its decode steps
    feed: list[int] = field(default_factory=list)  # fp32's greedy picks: decode i is fed feed[i - 1]
    slot: int = -1
    pos: int = 0  # the position of its next token
    ref: list = field(default_factory=list)  # logits per index: 0 prefill, i decode i
    fla: list = field(default_factory=list)
    ours: list = field(default_factory=list)
    kinds: list = field(default_factory=list)


def fla_request(model: Any, req: Request, greedy: bool) -> list:
    """fla's generation path for one request: the prompt, then one token a call with its
    cache (``past_key_values``), as ``generate`` calls the model. ``greedy``: pick each
    next token (into ``req.feed``); else feed ``req.feed``. Returns fp32 logits per index."""
    import torch

    out = model(input_ids=req.prompt[None], use_cache=True, logits_to_keep=1)
    cache, logits = out.past_key_values, [out.logits[0, -1].float()]
    for i in range(req.steps):
        if greedy:
            req.feed.append(int(logits[-1].argmax()))
        tok = torch.tensor([[req.feed[i]]], device=DEVICE)
        out = model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        logits.append(out.logits[0, -1].float())
    return logits


def serve_schedule(engine: Engine, requests: list[Request], steps: int, slot_order: list[int]) -> None:
    """Our engine over the schedule: step 0 prefills the first wave; step s decodes every
    request with ``start < s <= start + steps`` and prefills those with ``start == s`` in
    the same call; a finished request's slot goes to the next new one."""
    import torch

    free = list(slot_order)
    for s in range(steps + 1):
        decoding = [r for r in requests if r.start < s <= r.start + r.steps]
        joining = [r for r in requests if r.start == s]
        if not decoding and not joining:
            continue
        for r in joining:
            r.slot = free.pop(0)
        run = decoding + joining
        slots = torch.tensor([r.slot for r in run], dtype=torch.int32, device=DEVICE)
        fed = [r.feed[s - r.start - 1] for r in decoding]
        offsets = torch.tensor(
            [r.pos for r in decoding] + [0] * len(joining), dtype=torch.int32, device=DEVICE
        )
        if joining:
            lengths = [1] * len(decoding) + [len(r.prompt) for r in joining]
            cu = torch.tensor(
                [0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE
            )
            ids = torch.cat(
                [torch.tensor(fed, dtype=torch.long, device=DEVICE), *(r.prompt for r in joining)]
            )
            from_pool = torch.tensor([True] * len(decoding) + [False] * len(joining), device=DEVICE)
            step = Step(offsets, slots, cu, from_pool, len(decoding))
            logits = engine.logits(ids[None], step, last=(cu[1:] - 1).long())
            kind_d, kind_j = ("decode, mixed", "prefill, mixed") if decoding else (None, "prefill")
        else:
            step = Step(offsets, slots)
            logits = engine.logits(torch.tensor(fed, dtype=torch.long, device=DEVICE)[:, None], step)
            kind_d, kind_j = "decode", None
        for r, row in zip(run, logits.float()):
            r.ours.append(row)
        for r in decoding:
            r.kinds.append(kind_d)
            r.pos += 1
            if s == r.start + r.steps:
                free.insert(0, r.slot)  # the next new request takes it: its stale state must not leak
        for r in joining:
            r.kinds.append(kind_j)
            r.pos = len(r.prompt)


def nan_max(values: list[float]) -> float:
    """NaN where any value is (Python's max would skip it or not by its place)."""
    return math.nan if any(map(math.isnan, values)) else max(values)


def ratio(ours: float, fla: float) -> float:
    """ours / fla, where fla may be 0 (then 1 where ours is too, else inf)."""
    return ours / fla if fla else (1.0 if ours == 0 else math.inf)


def nan_median(values: list[float]) -> float:
    return math.nan if any(map(math.isnan, values)) else statistics.median(values)


def check() -> list[dict]:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    log("building the models")
    ref = build_model(torch.float32)
    ours_model = copy.deepcopy(ref).to(torch.bfloat16)  # fla's bf16 path and ours: the same weights
    for layer in ref.model.layers:
        layer.attn.mode = "fused_recurrent"  # the exact fp32 recurrence (the chunk kernel's dots run TF32)
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + 1)
    requests = []
    for length in WAVE1:
        steps = RETIRE_AFTER if len(requests) == 1 else STEPS
        requests.append(Request(len(requests), None, 0, steps))
        requests[-1].prompt = torch.randint(0, VOCAB, (length,), generator=gen, device=DEVICE)
    for length in WAVE2:
        requests.append(Request(len(requests), None, JOIN, STEPS - JOIN))
        requests[-1].prompt = torch.randint(0, VOCAB, (length,), generator=gen, device=DEVICE)
    engine = Engine(ours_model, POOL_SLOTS)
    with torch.no_grad():
        log("fp32 reference, per request, greedy")
        for r in requests:
            r.ref = fla_request(ref, r, greedy=True)
        log("fla bf16, per request, teacher-forced")
        for r in requests:
            r.fla = fla_request(ours_model, r, greedy=False)
        log("ours: the pool engine over the schedule")
        order = torch.randperm(POOL_SLOTS, generator=torch.Generator().manual_seed(SEED)).tolist()
        serve_schedule(engine, requests, STEPS, order)
        torch.cuda.synchronize()
    return judge(requests, engine.pools)


def judge(requests: list[Request], pools: list) -> list[dict]:
    """A row per (request, index) and the summary row with the verdict."""
    import torch

    used = sorted({r.slot for r in requests})
    unused = [s for s in range(pools[0].shape[0]) if s not in used]
    untouched = all(bool(p[unused].isnan().all()) for p in pools)

    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm())

    rows = []
    for r in requests:
        if not (len(r.ref) == len(r.fla) == len(r.ours) == r.steps + 1):
            raise RuntimeError(f"request {r.rid}: {len(r.ref)}, {len(r.fla)}, {len(r.ours)} logits")
        for i, (want, fla, ours) in enumerate(zip(r.ref, r.fla, r.ours)):
            rows.append({
                "what": "logits", "request": r.rid, "prompt": len(r.prompt), "slot": r.slot,
                "index": i, "kind": r.kinds[i], "position": len(r.prompt) - 1 + i,
                "ours_rel_l2": rel(ours, want), "fla_rel_l2": rel(fla, want), "ours_vs_fla": rel(ours, fla),
                "finite": bool(torch.isfinite(ours).all()),
                "ours_top1_as_fp32": int(ours.argmax()) == int(want.argmax()),
                "fla_top1_as_fp32": int(fla.argmax()) == int(want.argmax()),
            })  # fmt: skip
    summary = {"what": "logits summary", "points": len(rows), "ratio_allowed": RATIO}
    for key in ("ours_rel_l2", "fla_rel_l2", "ours_vs_fla"):
        values = [row[key] for row in rows]
        summary[f"{key}_max"], summary[f"{key}_median"] = nan_max(values), nan_median(values)
    for kind in sorted({row["kind"] for row in rows}):
        sub = [row for row in rows if row["kind"] == kind]
        summary[f"max by kind: {kind}"] = {
            "points": len(sub),
            "ours": nan_max([row["ours_rel_l2"] for row in sub]),
            "fla": nan_max([row["fla_rel_l2"] for row in sub]),
        }
    summary["finite"] = all(row["finite"] for row in rows)
    summary["unused_slots_untouched"] = untouched
    summary["top1_as_fp32"] = {
        p: sum(row[f"{p}_top1_as_fp32"] for row in rows) / len(rows) for p in ("ours", "fla")
    }
    summary["max_ratio"] = ratio(summary["ours_rel_l2_max"], summary["fla_rel_l2_max"])
    summary["median_ratio"] = ratio(summary["ours_rel_l2_median"], summary["fla_rel_l2_median"])
    summary["pass"] = bool(  # a NaN ratio compares false
        summary["finite"] and untouched and summary["max_ratio"] <= RATIO and summary["median_ratio"] <= RATIO
    )
    return rows + [summary]


# ---------------------------------------------------------------------------------------
# 2. The throughput


def speed():
    """The throughput rows, each yielded as soon as it is measured."""
    import torch

    log("building the model")
    fla_model = build_model(torch.bfloat16)
    fla_sized = copy.deepcopy(fla_model)
    ours_model = copy.deepcopy(fla_model)
    for layer in fla_sized.model.layers:  # tables made once, as ours are
        # The device as q's (cuda:N): another device string would rebuild the table.
        device = torch.device("cuda", torch.cuda.current_device())
        layer.attn.rotary._update_cos_sin_cache(MAX_POS, device=device, dtype=torch.bfloat16)
    gen = torch.Generator(device=DEVICE).manual_seed(SEED + 2)
    prompts = torch.randint(0, VOCAB, (BATCH, PROMPT), generator=gen, device=DEVICE)
    paths = {}

    with torch.no_grad():
        for name, model in (("fla", fla_model), ("fla, rotary tables made once", fla_sized)):
            out = model(input_ids=prompts, use_cache=True, logits_to_keep=1)
            state = {"cache": out.past_key_values, "next": out.logits[:, -1].argmax(-1, keepdim=True)}

            def fla_step(model=model, state=state):
                out = model(
                    input_ids=state["next"], past_key_values=state["cache"], use_cache=True, logits_to_keep=1
                )
                state["cache"], state["next"] = (
                    out.past_key_values,
                    out.logits[:, -1].argmax(-1, keepdim=True),
                )

            paths[name] = fla_step

        engine = Engine(ours_model, BATCH)
        cu = torch.arange(0, BATCH * PROMPT + 1, PROMPT, dtype=torch.int32, device=DEVICE)
        slots = torch.arange(BATCH, dtype=torch.int32, device=DEVICE)
        prefill = Step(torch.zeros(BATCH, dtype=torch.int32, device=DEVICE), slots, cu,
                       torch.zeros(BATCH, dtype=torch.bool, device=DEVICE))  # fmt: skip
        logits = engine.logits(prompts.reshape(1, -1), prefill, last=(cu[1:] - 1).long())
        ids = logits.argmax(-1, keepdim=True)  # [B, 1], the static input of every step
        decode = Step(torch.full((BATCH,), PROMPT, dtype=torch.int32, device=DEVICE), slots)

        def our_step():
            ids.copy_(engine.logits(ids, decode).argmax(-1, keepdim=True))
            decode.offsets.add_(1)

        paths["ours"] = our_step
        log("warm-up")
        for fn in paths.values():
            for _ in range(WARM):
                fn()
        base = {"what": "decode tokens/s", "batch": BATCH, "prompt": PROMPT, "timed_steps": TIMED}
        seconds = rounds(paths)
        fla_s = statistics.median(seconds["fla"])
        yield from speed_rows(base, seconds, fla_s)
        # After the eager rows are out: a failed capture can leave the context unusable.
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    our_step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                our_step()
            for _ in range(WARM):
                graph.replay()
        except Exception as e:  # optional: recorded
            log(f"no CUDA graph: {type(e).__name__}: {e}")
            yield base | {"path": "ours, CUDA graph", "error": f"{type(e).__name__}: {e}"[:300]}
            return
        # The graph beside our eager step again, alternating; vs_fla against the rounds above.
        again = rounds({"ours, again": our_step, "ours, CUDA graph": graph.replay})
        yield from speed_rows(base, again, fla_s)


def rounds(paths: dict) -> dict[str, list[float]]:
    """``ROUNDS`` alternating rounds of ``TIMED`` steps of each path: seconds per round."""
    import torch

    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for rnd in range(ROUNDS):
        for name, fn in paths.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(TIMED):
                fn()
            torch.cuda.synchronize()
            seconds[name].append(time.perf_counter() - t0)
        per_step = ", ".join(f"{n} {s[-1] * 1e3 / TIMED:.3f} ms/step" for n, s in seconds.items())
        log(f"round {rnd}: {per_step}")
    return seconds


def speed_rows(base: dict, seconds: dict[str, list[float]], fla_s: float):
    for name, s in seconds.items():
        median = statistics.median(s)
        yield base | {
            "path": name, "rounds": len(s), "tokens_per_s": BATCH * TIMED / median,
            "ms_per_step": median * 1e3 / TIMED, "round_ms_per_step": [x * 1e3 / TIMED for x in s],
            "vs_fla": fla_s / median,
        }  # fmt: skip


# ---------------------------------------------------------------------------------------
# The parent: each part in a child process under a timeout, then the table


def environment() -> dict:
    from importlib import metadata

    env = {}
    for pkg in ("torch", "flash-linear-attention", "fla-core", "transformers", "tilelang", "triton"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    try:
        env["commit"] = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    return env


def run_child(part: str, timeout: float) -> list[dict]:
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    }
    cmd = [sys.executable, __file__, "--child", part]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
        error = f"exit status {proc.returncode}" if proc.returncode else None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the child and what it started (nvcc)
        stdout, _ = proc.communicate()
        error = f"timed out after {timeout:g} s"
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return rows + ([{"what": part, "error": error}] if error else [])


def print_table(rows: list[dict]) -> None:
    for r in rows:
        if "error" in r:
            print(f"{r['what']}: {r.get('path', '')} {r['error']}")
    summary = next((r for r in rows if r["what"] == "logits summary"), None)
    if summary:
        print(f"\nlogits, relative L2 against fp32 over {summary['points']} (request, step) points")
        print(f"{'':<24} {'ours bf16':>10} {'fla bf16':>10} {'ours/fla':>9}")
        for stat in ("max", "median"):
            o, f = summary[f"ours_rel_l2_{stat}"], summary[f"fla_rel_l2_{stat}"]
            print(f"{stat:<24} {o:10.3e} {f:10.3e} {ratio(o, f):9.3f}")
        for key, v in summary.items():
            if key.startswith("max by kind: "):
                kind = f"max, {key[len('max by kind: ') :]} ({v['points']})"
                print(f"{kind:<24} {v['ours']:10.3e} {v['fla']:10.3e} {ratio(v['ours'], v['fla']):9.3f}")
        gap, top1 = summary, summary["top1_as_fp32"]
        print(f"ours vs fla bf16: max {gap['ours_vs_fla_max']:.3e}, median {gap['ours_vs_fla_median']:.3e}")
        print(f"top-1 as fp32's: ours {top1['ours']:.3f}, fla {top1['fla']:.3f} (informative)")
        print(
            f"finite {summary['finite']}, unused slots untouched {summary['unused_slots_untouched']}; "
            f"pass (ours <= {RATIO}x fla at max and median): {summary['pass']}"
        )
    speed_rows = [r for r in rows if r["what"] == "decode tokens/s" and "error" not in r]
    if speed_rows:
        print(f"\ndecode, batch {BATCH}, prompts of {PROMPT}, {TIMED} steps x {ROUNDS} rounds (median)")
        print("('again' and the graph: timed after the others, alternating with each other)")
        print(f"{'path':<30} {'tokens/s':>10} {'ms/step':>8} {'vs fla':>7}")
        for r in speed_rows:
            print(f"{r['path']:<30} {r['tokens_per_s']:10.0f} {r['ms_per_step']:8.3f} {r['vs_fla']:7.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    default = (
        Path(os.environ["OUT"]) / "serving_model.jsonl"
        if os.environ.get("OUT")
        else HERE / "serving_model.jsonl"
    )
    parser.add_argument("--out", type=Path, default=default)
    parser.add_argument("--only", choices=("check", "speed"), help="one part alone")
    parser.add_argument("--child", choices=("check", "speed"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        gpu = {"gpu": torch.cuda.get_device_name()}
        for row in check() if args.child == "check" else speed():
            print(json.dumps(gpu | row), flush=True)
        return
    model = {"hidden": HIDDEN, "layers": LAYERS, "heads": HEADS, "dk": HIDDEN // HEADS, "dv": HIDDEN // HEADS}
    head = environment() | model | {"vocab": VOCAB, "dtype": "bfloat16", "pool": "float32"}
    rows = []
    for part, timeout in (("check", CHECK_TIMEOUT_S), ("speed", SPEED_TIMEOUT_S)):
        if args.only in (None, part):
            rows += run_child(part, timeout)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("a") as f:
        for r in rows:
            f.write(json.dumps(head | r) + "\n")
    print_table(rows)


if __name__ == "__main__":
    main()
