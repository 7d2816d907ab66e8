"""Predicted vs measured step time and peak memory of measured-planned layouts on this machine's CPU.

Two gloo processes (one intra-op thread each, as ``torchrun`` gives a rank on a CPU) run, for each
model, a set of forced layouts (DP with ZeRO-0/1/2/3, TP, PP with GPipe and 1F1B, activation
checkpointing, CPU offload, gradient accumulation):

1. the gloo "link" is measured: all-reduce time against message size as a step issues it (after a
   burst of compute; :func:`measure_link`), fitted to the ring model ``2(p-1)(a + n/(pB))`` (p = 2), and
   given to the cluster spec as ``intra_node: {bandwidth_gbs: B, latency_us: a}``;
2. before the ranks start, this process measures the model's distinct blocks on its CPU
   (``whalepy.profile(..., measure=True, cpu_peers=1)``, one thread, beside one process running the model
   on the other core as the other rank will) at the micro-batch sizes and TP degrees the
   layouts use, plain and as the runtime lowers them (FSDP2 and DTensor on a fake process group, which
   needs a process outside the gloo job), and rank 0 predicts each layout's step time and per-rank peak
   memory from that profile on the measured cluster (``estimate_from_profile``);
3. both ranks build every layout (``whalepy.parallelize(plan=...)``) and run each through the closed
   loop's sampled step (``SAMPLED_STEP``, timed per block: the measured components), then train them
   side by side: ``--rounds`` rounds, each every layout for ``--steps`` timed steps (the slowest rank's),
   the order reversed every other round, so that a machine whose speed drifts over minutes slows every
   layout alike rather than the rows trained last; a layout's step time is the median over its rounds.
   Before the first round and after each, both ranks time the drift reference (:func:`reference_s`, also
   timed with the profile): the drift is printed, never applied to a prediction. Around each layout's
   steps in a round the CPU time other processes used and the ranks' waits for a core are measured and
   printed (:func:`disturbance`); a round whose wait passed :data:`WAIT_MAX` (another process held a
   core) is left out of that layout's median;
4. one more step under :func:`whalepy.trace_memory` gives each rank's peak tensor bytes (parameters,
   gradients, optimizer states, activations, temporaries; the CPU has no allocator peak to read).

Printed: one row per layout (with each round's time), the drift reference, the prediction's components
(compute, exposed communication, optimizer, bubble) next to the sampled step's (compute, optimizer, the
rest), the median and largest |error| of step time and memory, and the Spearman rank correlation of
predicted vs measured step times.

    python benchmarks/bench_predict_cpu.py [--steps 2] [--rounds 5] [--models gpt-deep,gpt-wide]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

GLOBAL_BATCH = 8

MODELS = {
    # name: (layers, hidden, heads, vocab, seq)
    "gpt-deep": (8, 128, 4, 512, 64),
    "gpt-wide": (4, 256, 8, 1024, 64),
}

LAYOUTS = [
    # label, ParallelConfig fields
    ("DP2 ZeRO-0", dict(dp=2)),
    ("DP2 ZeRO-1", dict(dp=2, zero_stage=1)),
    ("DP2 ZeRO-2", dict(dp=2, zero_stage=2)),
    ("DP2 ZeRO-3", dict(dp=2, zero_stage=3)),
    ("DP2 M2 (accumulation)", dict(dp=2, num_microbatches=2)),
    ("DP2 checkpoint all", dict(dp=2, checkpoint=True)),
    ("DP2 ZeRO-3 CPU offload", dict(dp=2, zero_stage=3, offload="cpu")),
    ("TP2", dict(dp=1, tp=2)),
    ("PP2 1F1B M4", dict(dp=1, pp=2, num_microbatches=4, schedule="1f1b")),
    ("PP2 GPipe M2", dict(dp=1, pp=2, num_microbatches=2, schedule="gpipe")),
]


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def build(name):
    from whalepy.models import GPT, GPTConfig

    layers, hidden, heads, vocab, seq = MODELS[name]
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=vocab, block_size=seq, num_layers=layers, num_heads=heads, hidden_size=hidden))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
    y = torch.randint(0, vocab, (GLOBAL_BATCH, seq), generator=g)
    return model, x, y


def _fit(rows):
    """Least-squares fit of ``t = 2a + n/B`` (ring all-reduce, p = 2) to ``(bytes, seconds)`` rows."""
    xs, ys = [n for n, _ in rows], [t for _, t in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    intercept = max(my - slope * mx, 1e-6)
    return intercept / 2, 1 / max(slope, 1e-15)


def _fit_in_step(ar, ag):
    """Least squares of the cost model's own formula for two ranks (``communication.estimate_collective_time``
    with a per-call cost ``L``): all-reduce of ``n`` bytes ``L + 2a + n/B``, all-gather of ``n`` output
    bytes ``L + a + n/(2B)``; ``(L, a, B)`` with ``L, a >= 0`` (a negative one is dropped and the rest refit)."""
    rows = [(1.0, 2.0, n, t) for n, t in ar] + [(1.0, 1.0, n / 2, t) for n, t in ag]

    def solve(cols):
        x = torch.tensor([[r[c] for c in cols] for r in rows], dtype=torch.float64)
        y = torch.tensor([r[3] for r in rows], dtype=torch.float64).unsqueeze(1)
        return torch.linalg.lstsq(x, y).solution.squeeze(1).tolist()

    for cols in ((0, 1, 2), (0, 2), (1, 2)):
        sol = dict(zip(cols, solve(cols)))
        if all(v >= 0 for v in sol.values()) and sol.get(2, 0) > 0:
            return sol.get(0, 0.0), sol.get(1, 0.0), 1 / sol[2]
    return 0.0, 0.0, 1e9


def measure_link(sizes=(1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22, 1 << 24), repeats=15, burst_gemms=6, runs=5):
    """Gloo collectives between the 2 ranks, measured two ways:

    - idle: an all-reduce alone, both ranks waiting for it (a barrier before each), fitted to the ring model;
    - in a step, as the runtime issues them: each rank first computes (``burst_gemms`` 256x256 GEMMs, about
      the work of one small block) and then issues the collective; its cost is the time of the pair minus
      the compute alone (medians of ``runs`` runs of ``repeats`` back-to-back pairs), for an all-reduce and an
      all-gather of each size. On CPU ranks that share the cores, gloo's threads wake after the compute
      and the ranks arrive apart: each call costs about the same whatever its kind and size, which the
      idle figure does not see, so the fit has a per-call cost ``L`` besides the per-step latency ``a``
      and the bandwidth ``B`` (:func:`_fit_in_step`). A third figure issues the all-reduce asynchronously
      before the compute and waits after it (FSDP2's prefetch, DDP's buckets): its excess over the compute
      alone is what overlap hides (none on CPU, ``cost_models.communication.CPU_OVERLAP_LOSS``), and it
      joins the all-reduce rows of the fit, as a step issues most of its collectives that way.
      A fourth, printed and not fitted, is a pipeline's: after the compute rank 0 sends ``n/2`` bytes to
      rank 1 and receives them back (an activation forward, its gradient back), per message.

    The in-step fit is the link given to the cluster spec: the planner charges what the step sees."""
    import torch.distributed as dist

    a = torch.randn(256, 256)

    def burst():
        for _ in range(burst_gemms):
            a @ a

    def per_iter(fn):
        for _ in range(2):
            fn()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats

    def in_step(fn):
        comp = statistics.median(per_iter(burst) for _ in range(runs))
        return max(statistics.median(per_iter(lambda: (burst(), fn())) for _ in range(runs)) - comp, 1e-6), comp

    idle, ar, ag, overlapped, p2p = [], [], [], [], []
    for n in sizes:
        t = torch.ones(n // 4)
        half = torch.ones(n // 8)
        dist.all_reduce(t)
        ts = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(t)
            ts.append(time.perf_counter() - t0)
        idle.append((n, statistics.median(ts)))
        s_ar, comp = in_step(lambda: dist.all_reduce(t))
        s_ag, _ = in_step(lambda: dist.all_gather_into_tensor(t, half))

        def async_pair():
            w = dist.all_reduce(t, async_op=True)
            burst()
            w.wait()

        asy = statistics.median(per_iter(async_pair) for _ in range(runs))
        rank = dist.get_rank()

        def exchange():  # a pipeline's two messages: an activation forward, a gradient back
            if rank == 0:
                dist.send(half, 1)
                dist.recv(half, 1)
            else:
                dist.recv(half, 0)
                dist.send(half, 0)

        s_p2p, _ = in_step(exchange)
        p2p.append((n // 2, s_p2p / 2))
        ar.append((n, s_ar))
        ag.append((n, s_ag))
        overlapped.append((n, max(asy - comp, 0.0)))
    # the fit takes the all-reduces both ways a step issues them: synchronously after compute (tensor
    # parallelism) and asynchronously before compute, waited after it (FSDP2's prefetch, DDP's buckets)
    call, lat, bw = _fit_in_step(ar + overlapped, ag)
    idle_lat, idle_bw = _fit(idle)
    return {"latency_s": lat, "bandwidth": bw, "call_latency_s": call, "idle_latency_s": idle_lat,
            "idle_bandwidth": idle_bw,
            "rows": [(n, i, s, g, o) for (n, i), (_, s), (_, g), (_, o) in zip(idle, ar, ag, overlapped)],
            "p2p": p2p}


def cluster_for(link):
    from whalepy import ClusterSpec

    return ClusterSpec.from_dict({"groups": [{"name": "cpu", "gpu": "CPU", "gpus_per_node": 2, "nodes": 1, "cpu_memory_gb": 8,
                                              "intra_node": {"bandwidth_gbs": link["bandwidth"] / 1e9,
                                                             "latency_us": link["latency_s"] * 1e6,
                                                             "call_latency_us": link.get("call_latency_s", 0.0) * 1e6}}]})


def measure(name, repeats=5):
    """Measured planning of ``name`` in this (non-distributed) process, one intra-op thread as a rank has:
    the blocks plain and as the runtime lowers them (FSDP2 and DTensor on a fake process group, which
    needs a process outside the gloo job)."""
    import whalepy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, x, _ = build(name)
        t0 = time.perf_counter()
        # device="cpu": the ranks' device; left out, a machine with a GPU would time the blocks there
        # cpu_peers=1: the blocks timed beside one other process running the model, as each rank computes
        # beside the other on this machine's cores (they share its cache and memory bandwidth)
        prof = whalepy.profile(model, (x,), measure=True, device="cpu", micro_batches=(1, 2, 4, 8), tp_degrees=(1, 2),
                               repeats=repeats, cpu_peers=1)
        took = time.perf_counter() - t0
        import dataclasses

        # the graph does not pickle to the ranks; the drift reference is timed right after the blocks
        return dataclasses.replace(prof, graph=None), took, reference_s(name)
    finally:
        torch.set_num_threads(threads)


def predict(prof, cluster):
    from whalepy.planner.estimate import ParallelConfig, estimate_from_profile

    out = []
    for label, cfg in LAYOUTS:
        est = estimate_from_profile(prof, cluster, ParallelConfig(**cfg), global_batch=GLOBAL_BATCH)
        rank_mem = {}
        for st in est.plan.stages:
            for r in st.all_ranks:
                # a CPU rank's "device" and "host" are the same memory: offloaded states count too,
                # less the host gradients the backward makes after the device's peak
                rank_mem[r] = st.cost.memory_bytes + st.cost.cpu_bytes - st.cost.cpu_grads_bytes
        out.append((label, est.plan, est.step_time_s, rank_mem, predicted_parts(est)))
    return out


def predicted_parts(est):
    """The prediction's components per step (the busiest stage's): compute, exposed communication (TP,
    p2p, FSDP2's exposed gathers, the gradient sync and post-step gathers, the loss report), the
    optimizer step and the pipeline bubble; they add up to the step time."""
    M = est.config.num_microbatches
    busiest = max(est.stages, key=lambda s: s.time_per_microbatch_s)
    sync = busiest.comm.sync_s
    return {"compute": est.compute_s, "comm": est.comm_s + M * busiest.comm.dp_s + sync,
            "optimizer": max(est.tail_s - sync, 0.0), "bubble": est.bubble_s}


def measured_parts(pm):
    """What the last step timed per block measured (``pm.observed.timing``: the closed loop's sampled step,
    ``SAMPLED_STEP``, then the first step of each round, :func:`sample_next_step`), the slowest stage's:
    its compute, optimizer step and the rest (exposed communication, bubble and host work, which the
    hooks cannot tell apart). A row's components are the median over the build's sample and the rounds'."""
    timing = pm.observed.timing if pm.observed is not None else None
    if timing is None or not timing.stages:
        return None
    s = max(timing.stages, key=lambda s: s.step_s)
    return {"step": s.step_s, "compute": s.compute_s, "optimizer": s.optimizer_s or 0.0, "rest": max(s.rest_s, 0.0)}


def sample_next_step(pm):
    """Time the next step per block, as the closed loop's sampled step does (its ``BlockTimer``, restarted;
    the step's ``pm.observed.timing`` replaces the last one). The hooks cost about 1% of a step (docs/
    benchmarks.md, "The block clock's own cost"), so the sampled step stays among the timed ones."""
    timer = getattr(getattr(pm, "reporter", None), "timer", None)
    if timer is not None:
        timer.start()


def reference_s(name, reps=5):
    """The drift reference: one plain forward and backward of the whole model at micro-batch 4 (the
    per-rank batch of the DP2 layouts) on one thread, the median of ``reps``. Timed once with the profile
    (alone) and on each rank after each round (both ranks at once, as they compute in a step): the ratio
    says how fast this machine ran the same work then. Reported, never applied to a prediction."""
    model, x, y = build(name)
    x, y = x[: GLOBAL_BATCH // 2], y[: GLOBAL_BATCH // 2]
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[1:])


def _barrier_ref(name):
    import torch.distributed as dist

    dist.barrier()
    t = torch.tensor([reference_s(name)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


WAIT_MAX = 0.25
"""A round in which a rank's main thread waited for a core more than this share of the time
(:func:`disturbance`) is left out of the layout's median (all its rounds are kept, and the row marked,
when every round was so). Why 0.25: in session 16's runs on this 2-core machine the rounds other work
did not reach waited 3-21% (the ranks' own gloo threads), those in which another engineer's job held a
core 30-56% (and the drift reference ran 2.2-2.5x the profile's): docs/benchmarks.md, "Session 16: step
time". It selects measurements; no prediction is scaled by it."""


def _busy_jiffies():
    with open("/proc/stat") as f:
        cols = [int(v) for v in f.readline().split()[1:]]
    return sum(cols) - cols[3] - cols[4]  # all but idle and iowait


def _own_cpu_s():
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run_delay_s():
    """Seconds this thread has waited runnable for a CPU (``/proc/thread-self/schedstat``, second field)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def disturbance(fn):
    """Run ``fn`` (a collective step of both ranks) and return ``(its result, others, wait)``, the same on
    every rank: ``others`` the cores other processes used meanwhile (the machine's busy CPU time from
    ``/proc/stat`` less both ranks' own from ``getrusage``, all their threads, gloo's included, over the
    wall time: they also fill the cores a rank leaves idle, a pipeline's bubble); ``wait`` the largest
    fraction of the wall time a rank's main thread waited runnable for a core (its scheduler run delay:
    another process or the rank's own gloo threads held them). Printed beside each figure; ``wait``
    decides which rounds a row's median takes (:data:`WAIT_MAX`); no figure is scaled by them."""
    import torch.distributed as dist

    hz = os.sysconf("SC_CLK_TCK")
    dist.barrier()
    j0, c0, w0, t0 = _busy_jiffies(), _own_cpu_s(), _run_delay_s(), time.perf_counter()
    out = fn()
    own, busy, wait = _own_cpu_s() - c0, (_busy_jiffies() - j0) / hz, _run_delay_s() - w0
    wall = time.perf_counter() - t0
    v = torch.tensor([own, busy, wait], dtype=torch.float64)
    mine = v.clone()
    dist.all_reduce(v[:1])  # both ranks' own CPU time
    dist.all_reduce(mine[2:], op=dist.ReduceOp.MAX)  # the longer wait
    dist.broadcast(v[1:2], src=0)  # the machine's busy time, rank 0's reading
    return out, max(float(v[1] - v[0]), 0.0) / wall, float(mine[2]) / wall


def build_run(name, plan, cluster):
    """One layout lowered and warmed up to and through the closed loop's sampled step (its per-stage
    timing): every layout stays built while the rounds run, so a round costs only its timed steps."""
    from whalepy.runtime._report import SAMPLED_STEP

    import whalepy

    model, x, y = build(name)
    pm = whalepy.parallelize(model, cluster, plan=plan, example_inputs=(x,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=GLOBAL_BATCH)
    for _ in range(SAMPLED_STEP):
        pm.train_step((x,), y)
    return pm, x, y


def timed_steps(pm, x, y, steps, sample_first=False):
    """``steps`` timed steps, each the slowest rank's (a barrier before each); ``sample_first``: the first
    one timed per block too (:func:`sample_next_step`, its hooks set after the barrier)."""
    import torch.distributed as dist

    ts = []
    for i in range(steps):
        dist.barrier()
        if sample_first and i == 0:
            sample_next_step(pm)
        t0 = time.perf_counter()
        pm.train_step((x,), y)
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(float(t))
    return ts


def _predicted(rank, name, prof, cluster):
    """Rank 0's :func:`predict` of ``name``'s layouts on ``cluster``, broadcast to every rank."""
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box = [predict(prof, cluster)]
        except Exception:  # noqa: BLE001 - rank 1 must not wait forever for the plans
            import traceback

            box = [traceback.format_exc()]
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise RuntimeError(f"rank 0 failed to predict {name}:\n{box[0]}")
    return box[0]


def worker(names, profiles, steps, rounds):
    """Predict every layout, build them all, then train them side by side: ``rounds`` rounds, each every
    layout for ``steps`` timed steps (in model order, then reversed in the next round, so that a drift
    over the run falls on every layout alike); a layout's step time is the median of the rounds' medians,
    over its rounds not disturbed by another process (:data:`WAIT_MAX`). Before the first round and after
    each round both ranks time the drift reference (:func:`reference_s`). The gloo link is measured before
    the first round, after the middle one and after the last; the predictions are made from the median of
    each of its figures (the layouts, forced, are built from the first)."""
    import torch.distributed as dist

    import whalepy

    rank = dist.get_rank()
    links = [measure_link()]
    cluster = cluster_for(links[0])
    runs = []
    for name in names:
        for label, plan, _, _, _ in _predicted(rank, name, profiles[name][0], cluster):
            (pm, x, y), others, wait = disturbance(lambda: build_run(name, plan, cluster))
            runs.append(dict(model=name, layout=label, pm=pm, x=x, y=y, parts=[(measured_parts(pm), wait)],
                             build_disturbance=(others, wait), rounds=[]))
    drift = [{name: _barrier_ref(name) for name in names}]  # before round 1, then after each round
    for r in range(rounds):
        for run in (runs if r % 2 == 0 else runs[::-1]):
            ts, others, wait = disturbance(lambda run=run: timed_steps(run["pm"], run["x"], run["y"], steps,
                                                                       sample_first=True))
            run["rounds"].append((statistics.median(ts), others, wait))
            run["parts"].append((measured_parts(run["pm"]), wait))
        drift.append({name: _barrier_ref(name) for name in names})
        if rank == 0:
            print(f"  round {r + 1}: reference " + ", ".join(f"{n} {1e3 * t:.1f} ms" for n, t in drift[-1].items()),
                  file=sys.stderr, flush=True)
        if r in (rounds // 2, rounds - 1):  # the link too, side by side: in the middle and at the end
            links.append(measure_link())
    # the prediction from the link each of whose figures is the median of its measurements
    link = dict(links[0], **{k: statistics.median(lk[k] for lk in links)
                             for k in ("latency_s", "bandwidth", "call_latency_s")})
    preds = {(name, label): (pred_s, rank_mem, parts) for name in names
             for label, _, pred_s, rank_mem, parts in _predicted(rank, name, profiles[name][0], cluster_for(link))}
    for run in runs:
        run["pred_s"], run["rank_mem"], run["pred_parts"] = preds[(run["model"], run["layout"])]
    rows = []
    for run in runs:
        pm = run.pop("pm")
        x, y = run.pop("x"), run.pop("y")
        peak = whalepy.trace_memory(pm, (x,), y).peak_bytes
        pm.close()
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak)
        rank_mem = run.pop("rank_mem")
        worst = max(range(len(peaks)), key=lambda r: abs(rank_mem[r] / peaks[r] - 1))
        parts = [p for p, w in run["parts"] if p is not None and w <= WAIT_MAX] or [
            p for p, _ in run["parts"] if p is not None]
        del run["parts"]
        run["meas_parts"] = ({k: statistics.median(p[k] for p in parts) for k in parts[0]} if parts else None)
        kept = [t for t, _, wait in run["rounds"] if wait <= WAIT_MAX]
        run["all_disturbed"] = not kept
        rows.append(dict(run, meas_s=statistics.median(kept or [t for t, _, _ in run["rounds"]]), pred_mem=rank_mem[worst],
                         meas_mem=peaks[worst], err_mem=rank_mem[worst] / peaks[worst] - 1,
                         measure_s=profiles[run["model"]][1]))
    return {"link": link, "links": links, "rows": rows, "drift": drift}


def spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5


def _ms(x):
    return f"{1e3 * x:.1f}"


def _round(t, others, wait):
    return f"{_ms(t)} [{others:.2f} {100 * wait:.0f}%]" + ("*" if wait > WAIT_MAX else "")


def main() -> None:
    from dist_harness import run_distributed

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=2, help="timed steps of each layout per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds over all layouts (median per layout)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeats", type=int, default=5, help="timed steps per measured block shape (median)")
    args = ap.parse_args()
    names = args.models.split(",")
    with open("/proc/loadavg") as f:
        load_before = f.read().split()[:3]
    t0 = time.perf_counter()
    profiles = {name: measure(name, args.repeats) for name in names}
    out = run_distributed(worker, 2, names, profiles, args.steps, args.rounds, timeout=3000)[0]
    with open("/proc/loadavg") as f:
        load_after = f.read().split()[:3]
    link, rows, drift = out["link"], out["rows"], out["drift"]
    print(f"command: python benchmarks/bench_predict_cpu.py --steps {args.steps} --rounds {args.rounds} "
          f"--models {args.models} --repeats {args.repeats}")
    print(f"load (1/5/15 min) before {' '.join(load_before)}, after {' '.join(load_after)}; "
          f"{os.cpu_count()} cores; torch {torch.__version__}; wall {time.perf_counter() - t0:.0f} s")
    print("gloo in a step, given to the cluster spec (before the first round / after the middle one / after the "
          "last -> the median of each figure, which the predictions use): per call "
          + " / ".join(f"{lk['call_latency_s'] * 1e6:.0f}" for lk in out["links"])
          + f" -> {link['call_latency_s'] * 1e6:.0f} us, latency per step "
          + " / ".join(f"{lk['latency_s'] * 1e6:.0f}" for lk in out["links"])
          + f" -> {link['latency_s'] * 1e6:.0f} us, bandwidth "
          + " / ".join(f"{lk['bandwidth'] / 1e9:.2f}" for lk in out["links"])
          + f" -> {link['bandwidth'] / 1e9:.2f} GB/s")
    print(f"gloo all-reduce fit, idle (the first measurement): latency {link['idle_latency_s'] * 1e6:.1f} us per "
          f"step, bandwidth {link['idle_bandwidth'] / 1e9:.2f} GB/s")
    for i, lk in enumerate(out["links"]):
        print(f"measurement {i + 1}, ms by size (all-reduce idle / all-reduce after compute / all-gather after "
              "compute / all-reduce issued before compute, beyond the compute):",
              "; ".join(f"{n >> 10} KiB {1e3 * a:.2f} / {1e3 * b:.2f} / {1e3 * g:.2f} / {1e3 * o:.2f}"
                        for n, a, b, g, o in lk["rows"]))
        print(f"measurement {i + 1}, ms per pipeline message after compute (send / recv between the ranks, beyond "
              "the compute; not given to the cluster spec, whose sends pay a + n/B):",
              "; ".join(f"{n >> 10} KiB {1e3 * t:.2f}" for n, t in lk["p2p"]))
    print("\ndrift reference (one plain forward + backward of the model at micro-batch 4, one thread; with the "
          "profile: this process alone; before round 1 and after each round: both ranks at once, the slower), ms:")
    for name in names:
        ref = profiles[name][2]
        print(f"  {name}: profile {_ms(ref)}; rounds " + ", ".join(
            f"{_ms(d[name])} ({d[name] / ref:.2f}x)" for d in drift))
    print(f"a row's measured step is the median over its rounds in which no rank's main thread waited for a core "
          f"more than {WAIT_MAX:.0%} of the time (WAIT_MAX; * a round left out; ! every round was, all kept); each "
          "round: ms [cores other processes used, that longest wait] (disturbance())")
    print("\n| model | layout | predicted ms | measured ms (rounds) | error | predicted MiB | measured MiB | error |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['layout']} | {_ms(r['pred_s'])} | {_ms(r['meas_s'])}{'!' * r['all_disturbed']} "
              f"({' / '.join(_round(*x) for x in r['rounds'])}) | {100 * (r['pred_s'] / r['meas_s'] - 1):+.1f}% | "
              f"{r['pred_mem'] / 2**20:.1f} | {r['meas_mem'] / 2**20:.1f} | {100 * r['err_mem']:+.1f}% |")
    print("\nComponents, ms per step (predicted: compute / exposed comm / optimizer / bubble; measured per block "
          "in the closed loop's sampled step and the first step of each round, the median, the slowest stage: "
          "step / compute / optimizer / rest = exposed comm + bubble + host; the build phase's disturbance):")
    print("\n| model | layout | pred compute | pred comm | pred opt | pred bubble | meas step | meas compute | "
          "meas opt | meas rest | others' cores, wait |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p, m = r["pred_parts"], r["meas_parts"]
        meas = (" | ".join(_ms(m[k]) for k in ("step", "compute", "optimizer", "rest")) if m is not None
                else "- | - | - | -")
        print(f"| {r['model']} | {r['layout']} | {_ms(p['compute'])} | {_ms(p['comm'])} | {_ms(p['optimizer'])} | "
              f"{_ms(p['bubble'])} | {meas} | {r['build_disturbance'][0]:.2f}, {100 * r['build_disturbance'][1]:.0f}% |")
    errs = [abs(r["pred_s"] / r["meas_s"] - 1) for r in rows]
    mems = [abs(r["err_mem"]) for r in rows]
    print(f"\nstep time |error|: median {100 * statistics.median(errs):.1f}%, max {100 * max(errs):.1f}%; "
          f"memory |error|: median {100 * statistics.median(mems):.1f}%, max {100 * max(mems):.1f}%")
    for name in names:
        sub = [r for r in rows if r["model"] == name]
        print(f"Spearman {name}: {spearman([r['pred_s'] for r in sub], [r['meas_s'] for r in sub]):.3f} "
              f"(measuring its blocks took {sub[0]['measure_s']:.1f} s)")
    print(f"Spearman all: {spearman([r['pred_s'] for r in rows], [r['meas_s'] for r in rows]):.3f}")


if __name__ == "__main__":
    main()
