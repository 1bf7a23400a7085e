"""The delay simulator reproduces hand-computed delayed gradient descent (the pipeline's reference semantics)."""
from __future__ import annotations

import pytest
import torch

from hf_asyncpp.optim import DelaySimulator

A = [1.5, 0.7, 2.0]  # curvature per stage
C = 0.3  # couples the first and the last stage, so a stage's gradient depends on another stage's (stale) weights
LR, STEPS = 0.1, 12


def grad_at(y):
    """Gradient of f(y) = 0.5 sum a_s y_s^2 + C y_0 y_last."""
    g = [a * v for a, v in zip(A, y)]
    g[0] += C * y[-1]
    g[-1] += C * y[0]
    return g


def run(mode, p, steps=STEPS, y0=(1.0, -2.0, 0.5), state=None):
    params = [torch.nn.Parameter(torch.tensor([v], dtype=torch.float64)) for v in y0[:p]]
    opt = torch.optim.SGD(params, lr=LR)
    sim = DelaySimulator(mode, [[q] for q in params])
    if state is not None:
        sim.load_state_dict(state[0])
        for q, v in zip(params, state[1]):
            q.data.copy_(v)
    traj = []
    for _ in range(steps):
        sim.before_forward()
        y = [q[0] for q in params]
        f = 0.5 * sum(a * v * v for a, v in zip(A, y)) + C * y[0] * y[-1]
        f.backward()
        if sim.after_backward():
            opt.step()
        opt.zero_grad()
        sim.after_step()
        traj.append([float(q) for q in params])
    return traj, (sim.state_dict(), [q.data.clone() for q in params])


def flat(traj):
    return [v for row in traj for v in row]


def test_delay_1_by_hand():
    y0 = [1.0, -2.0]
    x = [y0]  # x[0]
    hand = []
    for t in range(STEPS):
        # x[t+1] = x[t] - lr g(x[t-1]); step 0 applies nothing
        nxt = x[t] if t == 0 else [v - LR * g for v, g in zip(x[t], grad_at(x[t - 1]))]
        x.append(nxt)
        hand.append(nxt)
    traj, _ = run("1", 2, y0=y0)
    assert flat(traj) == pytest.approx(flat(hand), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("p", [2, 3])
def test_pipedream_by_hand(p):
    y0 = [1.0, -2.0, 0.5][:p]
    versions = [y0]  # W[t] for every stage
    hand = []
    for t in range(STEPS):
        point = [versions[max(0, t - (p - 1 - s))][s] for s in range(p)]  # stage s is p-1-s versions old
        nxt = [v - LR * g for v, g in zip(versions[t], grad_at(point))]
        versions.append(nxt)
        hand.append(nxt)
    traj, _ = run("pipedream", p, y0=y0)
    assert flat(traj) == pytest.approx(flat(hand), rel=1e-12, abs=1e-12)
    sync, _ = run("0", p, y0=y0)
    assert flat(traj) != pytest.approx(flat(sync))  # the delay is real


@pytest.mark.parametrize("mode", ["1", "pipedream"])
def test_resume_continues_exactly(mode):
    straight, _ = run(mode, 3)
    first, state = run(mode, 3, steps=5)
    rest, _ = run(mode, 3, steps=STEPS - 5, state=state)
    assert first + rest == straight


def test_keeps_only_the_versions_it_needs():
    params = [[torch.nn.Parameter(torch.zeros(2))] for _ in range(4)]
    sim = DelaySimulator("pipedream", params)
    for _ in range(10):
        sim.before_forward()
        sim.after_backward()
        sim.after_step()
    assert [len(h) for h in sim.history] == [3, 2, 1, 0]
    with pytest.raises(ValueError, match="simulate_delay: '2'"):
        DelaySimulator("2", params)
