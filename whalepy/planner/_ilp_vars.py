"""The ILP's variables and linear forms (split from :mod:`whalepy.planner.ilp`, whose module docstring
states the formulation): :class:`_Vars` holds every variable family, :func:`build_variables` creates
them for one candidate, and the helpers build the linear forms the constraint families share
(boundaries, blocks per chunk and stage, per-family costs paid once)."""

from __future__ import annotations

from dataclasses import dataclass, field

from whalepy.planner._coeffs import CandidateCoeffs
from whalepy.planner._solvers import _Model, _Var
from whalepy.planner.space import StateOption

_BILLION = 1e9


def _acc(d: dict, form: tuple[dict, float], coef: float) -> float:  # type: ignore[type-arg]
    """``d += coef * form`` (terms); returns ``coef * constant`` for the caller to add."""
    if coef == 0.0:
        return 0.0
    for var, a in form[0].items():
        d[var] = d.get(var, 0.0) + coef * a
    return coef * form[1]


@dataclass(slots=True)
class _Vars:
    q: list[list[_Var]]
    r: list[list[_Var]]
    nj: list[list[tuple[dict, float]]]
    """Blocks of segment g in virtual stage j, as a linear form."""
    n: list[list[tuple[dict, float]]]
    """Blocks of segment g on physical stage s."""
    c: list[list[_Var]]
    """Checkpointed blocks of segment g in virtual stage j."""
    h: list[list[_Var]]
    y: list[dict[StateOption, _Var]]
    Q: list[dict[StateOption, _Var]]
    T: _Var
    Tc: _Var | None
    X: _Var
    Nb: list[dict[StateOption, dict[int, _Var]]] = field(default_factory=list)
    o: list[dict[int, _Var]] = field(default_factory=list)
    """Blocks of segment g in virtual stage j whose activations are offloaded (only where allowed)."""
    fam: list[list[tuple[_Var, tuple[StateOption, ...]]]] = field(default_factory=list)
    """Per stage, ``(z, options)`` for each family of its options: ``z`` is 1 when the stage's blocks
    use them (an option of no family is a family of its own, ``z`` its ``y``). Per-stage costs that a
    family pays once (working set, first-block gathers, post-step communication, autocast copies) are
    charged on ``z``."""
    w: list[dict[int, _Var]] = field(default_factory=list)
    """Checkpointed blocks of segment g in virtual stage j whose input is in host memory (where allowed)."""
    tied: list[list[dict[StateOption, _Var]]] = field(default_factory=list)
    """Per stage, per tied copy (:attr:`StageCoeffs.tied_copies`), per option: 1 when the stage holds the
    copy with its holding blocks on that option (0 or more otherwise; only costs grow with it)."""
    Ts: list[_Var] = field(default_factory=list)
    """Per stage, its own time per micro-batch (``T`` is at least each): only in the tie-break's model
    (:func:`polish_candidate`); empty otherwise, where the stage rows bound ``T`` directly."""
    Xs: list[_Var] = field(default_factory=list)
    """Per stage, its own exposed synchronisation and optimizer step (``X`` is at least each); as ``Ts``."""


def _var(prob: _Model, name: str, lowBound: float | None = None, upBound: float | None = None,
         cat: str = "Continuous") -> _Var:
    return prob.var(name, lowBound, upBound, cat)


def _boundary(cc: CandidateCoeffs, v: _Vars, j: int) -> tuple[dict, float]:  # type: ignore[type-arg]
    d: dict = {}
    for g, seg in enumerate(cc.segments):
        if seg.start:
            d[v.q[j][g]] = float(seg.start)
        if seg.length > 1:
            d[v.r[j][g]] = 1.0
    return d, 0.0


def _cum(cc: CandidateCoeffs, v: _Vars, j: int, g: int) -> tuple[dict, float]:  # type: ignore[type-arg]
    """Blocks of segment g before virtual boundary j (j = 0: none; j = J: all)."""
    J = cc.candidate.num_virtual
    L = cc.segments[g].length
    if j == 0:
        return {}, 0.0
    if j == J:
        return {}, float(L)
    d = {v.q[j][gg]: float(L) for gg in range(g + 1, len(cc.segments))}
    if L > 1:
        d[v.r[j][g]] = 1.0
    return d, 0.0


def _add(prob: _Model, d: dict, const: float, sense: int, name: str) -> None:  # type: ignore[type-arg]
    """Add ``sum d + const (sense) 0``."""
    prob.rows.append((d, const, sense, name))


def build_variables(prob: _Model, cc: CandidateCoeffs, per_stage: bool = False) -> _Vars:
    cand = cc.candidate
    S, J, G, V = cand.num_stages, cand.num_virtual, len(cc.segments), cand.virtual_stages
    q = [[]] + [[_var(prob, f"q_{j}_{g}", cat="Binary") for g in range(G)] for j in range(1, J)]
    r = [[]] + [[_var(prob, f"r_{j}_{g}", lowBound=0, upBound=max(0, cc.segments[g].length - 1),
                      cat="Integer") for g in range(G)] for j in range(1, J)]
    v = _Vars(q=q, r=r, nj=[], n=[], c=[], h=[], y=[], Q=[], T=_var(prob, "T", lowBound=0),
              Tc=_var(prob, "Tc", lowBound=0) if V > 1 else None, X=_var(prob, "X", lowBound=0))
    v.Nb = [dict() for _ in range(J)]
    cum = [[_cum(cc, v, j, g) for g in range(G)] for j in range(J + 1)]
    for j in range(J):
        row = []
        for g in range(G):
            d: dict = {}
            const = _acc(d, cum[j + 1][g], 1.0) + _acc(d, cum[j][g], -1.0)
            row.append((d, const))
        v.nj.append(row)
        v.c.append([_var(prob, f"c_{j}_{g}", lowBound=0, upBound=cc.segments[g].length, cat="Integer")
                    for g in range(G)])
    for s in range(S):
        row = []
        for g in range(G):
            d = {}
            const = sum(_acc(d, v.nj[s + k * S][g], 1.0) for k in range(V))
            row.append((d, const))
        v.n.append(row)
        v.h.append([_var(prob, f"h_{s}_{g}", cat="Binary") for g in range(G)])
        sc = cc.stages[s]
        v.y.append({o: _var(prob, f"y_{s}_{i}", cat="Binary") for i, o in enumerate(sc.options)})
        v.Q.append({o: _var(prob, f"Q_{s}_{i}", lowBound=0) for i, o in enumerate(sc.options)})
        grouped = {o for f in sc.families for o in f}
        v.fam.append([(_var(prob, f"z_{s}_{i}", cat="Binary"), f) for i, f in enumerate(sc.families)]
                     + [(v.y[s][o], (o,)) for o in sc.options if o not in grouped])
    if per_stage:
        v.Ts = [_var(prob, f"Ts_{s}", lowBound=0) for s in range(S)]
        v.Xs = [_var(prob, f"Xs_{s}", lowBound=0) for s in range(S)]
    return v


def _once(v: _Vars, s: int, coef: dict[StateOption, float], scale: float = 1.0) -> dict[_Var, float]:
    """``sum_f coef[f] z_f``: a per-stage cost of the chosen family, paid once however many of its
    options the stage's blocks use (the family's options share the value)."""
    return {z: coef[f[0]] * scale for z, f in v.fam[s] if coef[f[0]]}


def _stage_ckpt(v: _Vars, S: int, V: int, s: int, g: int) -> list[_Var]:
    return [v.c[s + k * S][g] for k in range(V)]
