"""The ILP's cost constraint families (split from :mod:`whalepy.planner.ilp`, whose module docstring
states the formulation): the time of every cell and chunk per micro-batch, the tail (optimizer step and
exposed synchronisation), device memory per cell and host memory and NVMe per node, each read off the
candidate's coefficients as :func:`~whalepy.planner.costing.evaluate` reads them."""

from __future__ import annotations

from whalepy.cost_models.devices import GIB
from whalepy.planner._coeffs import CandidateCoeffs, stage_host_activation, stage_host_checkpoint
from whalepy.planner._ilp_vars import _BILLION, _acc, _add, _once, _stage_ckpt, _var, _Vars
from whalepy.planner._solvers import LE, _Model, _Var


def _host_copy_terms(d: dict, cell, v: _Vars, j: int, g: int) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Add the seconds of the host copies of segment ``g`` in virtual stage ``j`` to a time row ``d``:
    offloaded activations (``o``) and checkpointed inputs in host memory (``w``)."""
    for xs, coef in ((v.o, cell.seg_offload), (v.w, cell.seg_ckoff)):
        x = xs[j].get(g) if xs else None
        if x is not None and coef[g]:
            d[x] = d.get(x, 0.0) + coef[g]


def _option_terms(base: dict, v: _Vars, s: int, sc, chunks: list[int], per: dict, edge: dict) -> dict | None:  # type: ignore[no-untyped-def, type-arg]
    """``base + sum_o (sum_{j in chunks} sum_g Nb[j][o][g] per[o][g] + edge[o] y[s][o])`` (the chosen
    option's exposed communication added), or None when no option exposes any."""
    d = dict(base)
    for x, a in _once(v, s, edge).items():
        d[x] = d.get(x, 0.0) + a
    for o in sc.options:
        for j in chunks:
            for g, x in v.Nb[j].get(o, {}).items():
                if per[o][g]:
                    d[x] = d.get(x, 0.0) + per[o][g]
    return d if len(d) > len(base) else None


def add_time_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    G = len(cc.segments)
    for s, sc in enumerate(cc.stages):
        tv = v.Ts[s] if v.Ts else v.T
        if v.Ts:
            _add(prob, {tv: 1.0, v.T: -1.0}, 0.0, LE, f"time_stage_{s}")
        for ci, cell in enumerate(sc.cells):
            d: dict = {tv: -1.0}
            const = cell.p2p
            for g in range(G):
                const += _acc(d, v.n[s][g], cell.seg_time[g])
                if cell.seg_recompute[g]:
                    for x in _stage_ckpt(v, S, V, s, g):
                        d[x] = d.get(x, 0.0) + cell.seg_recompute[g]
                for k in range(V):
                    _host_copy_terms(d, cell, v, s + k * S, g)
            _add(prob, d, const, LE, f"time_compute_{s}_{ci}")
            dd = _option_terms(d, v, s, sc, [s + k * S for k in range(V)], cell.seg_exposed,
                               {o: V * cell.edge[o] for o in sc.options})
            if dd is not None:
                _add(prob, dd, const, LE, f"time_dp_{s}_{ci}")
            fetch = {v.Q[s][o]: cell.fetch_beta[o] * _BILLION for o in sc.options if cell.fetch_beta[o]}
            if fetch:
                _add(prob, {**fetch, tv: -1.0}, cell.p2p, LE, f"time_fetch_{s}_{ci}")
            if v.Tc is None:
                continue
            for k in range(V):
                j = s + k * S
                d = {v.Tc: -1.0}
                const = cell.chunk_p2p[k]
                for g in range(G):
                    const += _acc(d, v.nj[j][g], cell.seg_time[g])
                    if cell.seg_recompute[g]:
                        d[v.c[j][g]] = d.get(v.c[j][g], 0.0) + cell.seg_recompute[g]
                    _host_copy_terms(d, cell, v, j, g)
                _add(prob, d, const, LE, f"chunk_time_{s}_{ci}_{k}")
                dd = _option_terms(d, v, s, sc, [j], cell.seg_exposed, cell.edge)
                if dd is not None:
                    _add(prob, dd, const, LE, f"chunk_dp_{s}_{ci}_{k}")
            pmax = max(cell.chunk_p2p)
            if fetch:
                _add(prob, {**{x: a / V for x, a in fetch.items()}, v.Tc: -1.0}, pmax, LE,
                     f"chunk_fetch_{s}_{ci}")


def add_tail_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    dp = cc.candidate.dp
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    for s, sc in enumerate(cc.stages):
        xv = v.Xs[s] if v.Xs else v.X
        if v.Xs:
            _add(prob, {xv: 1.0, v.X: -1.0}, 0.0, LE, f"tail_stage_{s}")
        post: dict = _once(v, s, {o: a for o, (a, _) in sc.sync.items()})
        for o in sc.options:
            b = sc.sync[o][1]
            if b:
                post[v.Q[s][o]] = b * _BILLION
        for ci, cell in enumerate(sc.cells):
            d = {v.Q[s][o]: cell.opt_beta[o] * _BILLION for o in sc.options}
            if dp > 1:
                for x, a in post.items():
                    d[x] = d.get(x, 0.0) + a
            for k, per in enumerate(v.tied[s] if v.tied else ()):  # tied copies' gradient all-reduce
                for o, x in per.items():
                    if sc.tied_sync[ci][k][o]:
                        d[x] = d.get(x, 0.0) + sc.tied_sync[ci][k][o]
            d[xv] = -1.0
            _add(prob, d, 0.0, LE, f"tail_opt_{s}_{ci}")
            # the per-step tail: reductions (all 0 without replicas) and measured DTensor optimizer overhead
            dd = _option_terms(d, v, s, sc, [s + k * S for k in range(V)], cell.seg_tail, cell.tail_edge)
            if dd is not None:
                _add(prob, dd, 0.0, LE, f"tail_sync_{s}_{ci}")
            lap = {v.Q[s][o]: cell.opt_overlap[o] * _BILLION for o in sc.options if cell.opt_overlap[o]}
            if lap:
                # ZeRO-Offload: the gradient copies and CPU step beside the last backward are exposed
                # past its end: X >= (the row above) + overlap - backward; below zero that row binds
                dl = dict(dd if dd is not None else d)
                for x, a in lap.items():
                    dl[x] = dl.get(x, 0.0) + a
                const = 0.0
                for g in range(len(cc.segments)):
                    const += _acc(dl, v.n[s][g], -cell.seg_bwd[g])
                _add(prob, dl, const, LE, f"tail_offload_{s}_{ci}")


def _row_terms(d: dict, v: _Vars, s: int, sc, S: int, V: int, coef: dict, scale: float = 1.0) -> None:  # type: ignore[no-untyped-def, type-arg]
    """Add to ``d`` FSDP2's uneven rows on stage ``s`` (:attr:`StageCoeffs.seg_excess`, the tied copies'
    ``row_excess``), charged like parameters at ``coef[o]`` bytes each for the options that split rows
    (:attr:`StageCoeffs.row_options`), in GiB times ``scale``: ``sum_o coef_o (sum_{j of s} sum_g
    Nb[j][o][g] excess_g + sum_k held_k,o excess_k)`` (nothing where no row is uneven)."""
    for o in sc.row_options:
        a = coef[o] * scale / GIB
        if not a:
            continue
        for k in range(V):
            for g, x in v.Nb[s + k * S].get(o, {}).items():
                if sc.seg_excess and sc.seg_excess[g]:
                    d[x] = d.get(x, 0.0) + a * sc.seg_excess[g]
        for k, per in enumerate(v.tied[s] if v.tied else ()):
            x, e = per.get(o), sc.tied_copies[k].row_excess
            if x is not None and e:
                d[x] = d.get(x, 0.0) + a * e


def _held_states(v: _Vars, s: int, sc, S: int, V: int, without_grads) -> dict:  # type: ignore[no-untyped-def, type-arg]
    """Stage ``s``'s model states, buffers and FSDP2 working set in GiB (per option variable, FSDP2's
    uneven rows, the working set once), the gradients left out for the options where
    ``without_grads(o)``: at that peak the runtime has not created them yet."""
    grads = {o: sc.state_split[o][1] if without_grads(o) else 0.0 for o in sc.options}
    d = {v.Q[s][o]: (sc.mem_beta[o] + sc.buffer_beta[o] - grads[o]) * _BILLION / GIB for o in sc.options}
    if sc.row_options:  # the first replica's shards of uneven first dimensions
        _row_terms(d, v, s, sc, S, V, {o: sc.mem_beta[o] - grads[o] for o in sc.options})
    for x, a in _once(v, s, sc.working_bytes, 1.0 / GIB).items():
        d[x] = d.get(x, 0.0) + a
    return d


def add_memory_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    S, V = cc.candidate.num_stages, cc.candidate.virtual_stages
    G = len(cc.segments)
    for s, sc in enumerate(cc.stages):
        full = _held_states(v, s, sc, S, V, lambda o: False)
        # at the activation peak, gradients the runtime has not created yet are not held
        states = _held_states(v, s, sc, S, V, lambda o, sc=sc: sc.grads_freed[o])
        # at the loss's backward the running block's gradient buffer is not allocated yet
        for x, a in _once(v, s, sc.working_grad, -1.0 / GIB).items():
            states[x] = states.get(x, 0.0) + a
        block_any = any(sc.block_grad.get(o) for o in sc.options)
        freed_any = any(sc.grads_freed[o] for o in sc.options)
        for ci, cell in enumerate(sc.cells):
            k_in = cell.inflight / GIB
            ckpt_any = [g for g in range(G) if cell.seg_saved[g] > 0]
            # autocast's extras per block (the same for every option that trains under autocast), and
            # the families that do: their z is 1 when the stage's blocks use autocast
            amp = [max(cell.seg_amp_saved[o][g] for o in sc.options) for g in range(G)]
            amp_fam = {z: 1.0 for z, f in v.fam[s] if any(cell.seg_amp_saved[f[0]])} if any(amp) else {}
            P = _var(prob, f"P_{s}_{ci}", lowBound=0) if ckpt_any else None
            if P is not None:
                for g in ckpt_any:
                    # P >= h (saved + amp) - amp (1 - autocast): a block recomputed under autocast
                    # holds its extras too
                    d = {P: -1.0, v.h[s][g]: (cell.seg_saved[g] + amp[g]) / GIB}
                    if amp[g] and amp_fam:
                        for z in amp_fam:
                            d[z] = d.get(z, 0.0) + amp[g] / GIB
                    _add(prob, d, -amp[g] / GIB if amp[g] and amp_fam else 0.0, LE,
                         f"memory_recompute_{s}_{ci}_{g}")

            def kept_amp(j: int) -> _Var | None:
                """``A >= k_in sum_g amp_g (blocks - checkpointed - offloaded) - M (1 - autocast)``,
                ``A >= 0``: autocast's extras of the blocks that keep their activations, zero for a
                family without autocast (big M: every block of the segments kept)."""
                if not amp_fam:
                    return None
                A = _var(prob, f"Aamp_{s}_{ci}_{j}", lowBound=0)
                big = k_in * sum(a * seg.length for a, seg in zip(amp, cc.segments))
                d: dict = {A: -1.0}
                const = -big
                for g in range(G):
                    if not amp[g]:
                        continue
                    const += _acc(d, v.nj[j][g], k_in * amp[g])
                    d[v.c[j][g]] = d.get(v.c[j][g], 0.0) - k_in * amp[g]
                    x = v.o[j].get(g)
                    if x is not None:
                        d[x] = d.get(x, 0.0) - k_in * amp[g]
                for z in amp_fam:
                    d[z] = d.get(z, 0.0) + big
                _add(prob, d, const, LE, f"memory_autocast_{s}_{ci}_{j}")
                return A

            def kept(j: int) -> tuple[dict, float]:  # type: ignore[type-arg]
                d: dict = {}
                const = 0.0
                for g in range(G):
                    const += _acc(d, v.nj[j][g], k_in * cell.seg_saved[g])
                    extra = k_in * (cell.seg_input[g] - cell.seg_saved[g])
                    if extra:
                        d[v.c[j][g]] = d.get(v.c[j][g], 0.0) + extra
                    x = v.o[j].get(g)
                    if x is not None:  # an offloaded block keeps nothing on the device
                        d[x] = -k_in * cell.seg_saved[g]
                    x = v.w[j].get(g) if v.w else None
                    if x is not None:  # nor does a checkpointed one whose input is in host memory
                        d[x] = -k_in * cell.seg_input[g]
                A = kept_amp(j)
                if A is not None:
                    d[A] = 1.0
                return d, const

            d = dict(states)
            loss = cell.loss_bytes / GIB
            held = cell.loss_held_bytes / GIB  # GPipe's last stage: the other micro-batches' outputs
            if P is not None:
                d[P] = 1.0
            if V == 1:
                ks = kept(s)
                const = _acc(d, ks, 1.0)
                if cell.inflight > 1 and any(sc.grads_after_forwards.get(o) for o in sc.options):
                    # GPipe, after the first micro-batch's backward: every gradient, the other
                    # micro-batches' activations, their recomputed block and loss backward
                    d2 = _held_states(v, s, sc, S, V, lambda o, sc=sc: sc.grads_freed[o]
                                      and not sc.grads_after_forwards.get(o))
                    if P is not None:
                        d2[P] = 1.0
                    const2 = _acc(d2, ks, (cell.inflight - 1) / cell.inflight)
                    const2 += loss + held * (cell.inflight - 2) / (cell.inflight - 1)
                    _add(prob, d2, const2 - cell.capacity / GIB, LE, f"memory_gpipe_{s}_{ci}")
            else:
                A = _var(prob, f"A_{s}_{ci}", lowBound=0)
                for k in range(V):
                    kd, kc = kept(s + k * S)
                    kd[A] = -1.0
                    _add(prob, kd, kc, LE, f"activations_{s}_{ci}_{k}")
                d[A] = 1.0
                const = 0.0
            _add(prob, d, const + loss + held - cell.capacity / GIB, LE, f"memory_{s}_{ci}")
            if block_any:  # the first block's backward: its gradients, the loss's tensors freed
                d3 = dict(d)
                for x, a in _once(v, s, sc.block_grad, 1.0 / GIB).items():
                    d3[x] = d3.get(x, 0.0) + a
                _add(prob, d3, const + held - cell.capacity / GIB, LE, f"memory_block_{s}_{ci}")
            if freed_any:  # the end of backward: every gradient, no activations
                _add(prob, dict(full), -cell.capacity / GIB, LE, f"memory_states_{s}_{ci}")


def add_node_constraints(prob: _Model, cc: CandidateCoeffs, v: _Vars) -> None:
    """Host memory and NVMe are the node's, shared by its GPUs whichever stages they run: per node,
    ``sum_s (ranks of s on it) * sum_o beta_o Q[s][o] <= capacity``."""
    for ni, node in enumerate(cc.nodes):
        for kind, cap in (("host_memory", node.cpu_capacity), ("nvme", node.nvme_capacity)):
            d: dict = {}
            for s, sc in enumerate(cc.stages):
                k = node.ranks_per_stage[s]
                beta = sc.cpu_beta if kind == "host_memory" else sc.nvme_beta
                for o in sc.options:
                    if k and beta[o]:
                        d[v.Q[s][o]] = k * beta[o] * _BILLION / GIB
                    if kind == "host_memory" and k and sc.host_fixed.get(o):  # staging buffers
                        d[v.y[s][o]] = d.get(v.y[s][o], 0.0) + k * sc.host_fixed[o] / GIB
                if k and sc.row_options:  # every rank charged the first replica's uneven rows
                    _row_terms(d, v, s, sc, cc.candidate.num_stages, cc.candidate.virtual_stages, beta, k)
                # offloaded activations and checkpointed inputs in host memory, per rank
                for xs, per_rank in ((v.o, stage_host_activation), (v.w, stage_host_checkpoint)):
                    chunks = [xs[s + kk * cc.candidate.num_stages] for kk in range(cc.candidate.virtual_stages)
                              ] if kind == "host_memory" and k and xs else []
                    host = per_rank(sc) if any(chunks) else []
                    for row in chunks:
                        for g, x in row.items():
                            if host[g]:
                                d[x] = d.get(x, 0.0) + k * host[g] / GIB
            if d:
                _add(prob, d, -(cap or 0.0) / GIB, LE, f"{kind}_node_{ni}")
