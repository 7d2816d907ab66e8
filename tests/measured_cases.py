"""Per-rank worker for tests/test_measured_planning.py (no tests here): a measured plan's steps on
gloo against the same steps in one process."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def build(layers: int = 3):
    from whalepy.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, num_layers=layers, num_heads=2, hidden_size=32))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 64, (4, 16), generator=g)
    y = torch.randint(0, 64, (4, 16), generator=g)
    return model, x, y


def loss_fn(logits, y):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def reference_losses(steps: int) -> list[float]:
    model, x, y = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = []
    for _ in range(steps):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        out.append(loss.item())
    return out


def _train(plan, steps: int):
    import logging

    import whalepy

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("whalepy").addHandler(handler)
    model, x, y = build()
    pm = whalepy.parallelize(model, None, plan=plan, example_inputs=(x,), loss_fn=loss_fn,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), global_batch=4)
    losses, early = [], None
    for i in range(steps):
        losses.append(float(pm.train_step((x,), y)))
        if i == 4:
            early = pm.measured_profile()  # None: the sampled step (the 6th) has not run
    prof = pm.measured_profile()
    assert isinstance(prof, whalepy.ModelProfile) and prof.measured is not None
    assert [b.name for b in prof.blocks] == [b.name for b in pm.reporter.timer.profile.blocks]
    logging.getLogger("whalepy").removeHandler(handler)
    logged = ([n for n in lines if "more than 15% off" in n and "profile=pm.measured_profile()" in n],
              [n for n in lines if "timed per block" in n])
    return losses, early, prof.measured, pm.observed, logged


def run_plans(plans, steps: int):
    """``steps`` steps of each plan in turn, in the same processes; per plan what the closed loop gives:
    the losses, ``measured_profile()`` after step 5 and its measured costs at the end, ``pm.observed``,
    and what it logged: the off-plan warnings and the per-stage report."""
    return [_train(plan, steps) for plan in plans]


def cli_model():
    """For ``whalepy calibrate --model measured_cases:cli_model``: ``(model, example_inputs)``."""
    model, x, _ = build()
    return model, (x,)


def measure_in_a_job() -> tuple[int, int, int]:
    """Inside a torch.distributed job (one gloo rank): measure=True times the blocks as lowered in
    another process; what it recorded (wrapped rows, FSDP2 unit counts, measured updates)."""
    import whalepy

    model, x, _ = build(2)
    # the optimizer as users pass it, a lambda: it cannot pickle, so it travels as its class and settings
    m = whalepy.profile(model, (x,), measure=True, micro_batches=(2,), tp_degrees=(1,), repeats=1,
                        optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.5, weight_decay=0.25)).measured
    return len(m.wrapped), sum(m.fsdp_units.values()), len(m.wrapped_updates)


