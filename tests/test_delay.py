"""The delay simulator reproduces hand-computed delayed gradient descent (the pipeline's reference semantics),
keeps only the versions it needs, and resumes exactly together with the optimizer and the EF correction."""
from __future__ import annotations

import io

import pytest
import torch

from hf_asyncpp.config.optimizer import OptimizerConfig
from hf_asyncpp.optim import DelaySimulator, apply_delay_correction, build_optimizer

A = [1.5, 0.7, 2.0, 1.1]  # curvature per stage
C = 0.3  # couples the first and the last stage, so a stage's gradient depends on another stage's (stale) weights
LR, STEPS = 0.1, 12
Y0 = [1.0, -2.0, 0.5, 0.8]


def grad_at(y):
    """Gradient of f(y) = 0.5 sum a_s y_s^2 + C y_0 y_last (closed form)."""
    g = [a * v for a, v in zip(A, y)]  # zip stops at len(y): p stages use the first p entries
    g[0] += C * y[-1]
    g[-1] += C * y[0]
    return g


def lr_of(k):
    """The lr of the k-th applied update (a schedule, so the test sees which update used which lr)."""
    return LR / (1 + 0.1 * k)


def run(mode, p, steps=STEPS, start=0):
    """Plain SGD through the trainer's protocol, with a LambdaLR that advances on applied updates only."""
    params = [torch.nn.Parameter(torch.tensor([v], dtype=torch.float64)) for v in Y0[:p]]
    opt = torch.optim.SGD(params, lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_of(k) / LR)
    sim = DelaySimulator(mode, [[q] for q in params], start_step=start)
    traj = []
    for _ in range(steps):
        sim.before_forward()
        y = [q[0] for q in params]
        f = 0.5 * sum(a * v * v for a, v in zip(A, y)) + C * y[0] * y[-1]  # grad_at's f
        f.backward()
        if sim.after_backward():
            opt.step()
            sched.step()
        opt.zero_grad()
        sim.after_step()
        traj.append([q.item() for q in params])
    return traj


def flat(traj):
    return [v for row in traj for v in row]


def test_sync_start_by_hand():
    """delay_start_step K: steps 0..K-1 synchronous, step K too (the delay starts as a pipeline starts, with no
    older version), then each step's gradient at the previous step's weights."""
    K = 4
    x, prev, hand = Y0[:2], None, []
    for t in range(STEPS):
        at = x if t <= K else prev
        prev = x
        x = [v - lr_of(t) * g for v, g in zip(x, grad_at(at))]
        hand.append(x)
    assert flat(run("1", 2, start=K)) == pytest.approx(flat(hand), abs=1e-12)
    assert run("1", 2, start=K)[:K + 1] == run("0", 2)[:K + 1] and run("1", 2, start=K)[K + 1] != run("0", 2)[K + 1]


def test_sync_by_hand():
    x, hand = Y0[:2], []
    for t in range(STEPS):
        x = [v - lr_of(t) * g for v, g in zip(x, grad_at(x))]
        hand.append(x)
    assert flat(run("0", 2)) == pytest.approx(flat(hand), rel=1e-12, abs=1e-12)


def test_delay_1_by_hand():
    x = [Y0[:2]]  # x[0]; x[-1] = x[0]
    for t in range(STEPS):
        # x[t+1] = x[t] - lr(t) g(x[t-1]): every step applies an update, as the executor's STEP{t} does
        x.append([v - lr_of(t) * g for v, g in zip(x[t], grad_at(x[max(0, t - 1)]))])
    traj = run("1", 2)
    assert flat(traj) == pytest.approx(flat(x[1:]), rel=1e-12, abs=1e-12)
    assert flat(traj) != pytest.approx(flat(run("0", 2)))  # the delay is real


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipedream_by_hand(p):
    versions = [Y0[:p]]  # W[t] for every stage
    for t in range(STEPS):
        point = [versions[max(0, t - (p - 1 - s))][s] for s in range(p)]  # stage s is p-1-s versions old, clamped at W[0]
        versions.append([v - lr_of(t) * g for v, g in zip(versions[t], grad_at(point))])
    traj = run("pipedream", p)
    assert flat(traj) == pytest.approx(flat(versions[1:]), rel=1e-12, abs=1e-12)
    assert flat(traj) != pytest.approx(flat(run("0", p)))
    if p == 2:  # with two stages only stage 0 is stale, so this is not 2BW's uniform delay either
        assert flat(traj) != pytest.approx(flat(run("1", p)))


def test_delay_1_stashes_one_version_and_applies_every_step():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    sim = DelaySimulator(1, [a, b])  # an int mode and a flat list are accepted
    for t in range(4):
        sim.before_forward()  # step t computes at x[max(0, t-1)] = max(0, t-1) * 10 + 1
        assert a[0].item() == max(0, t - 1) * 10 + 1 and b[0].item() == max(0, t - 1) * 10 + 1
        a.grad = torch.full((2,), float(t))  # b gets no gradient: None stays None
        assert sim.after_backward() is True  # every step has its gradient to apply
        assert a[0].item() == t * 10 + 1 and torch.equal(a.grad, torch.full((2,), float(t))) and b.grad is None
        with torch.no_grad():
            a.add_(10.0), b.add_(10.0)  # "the update": x[t+1] = x[t] + 10
        a.grad = None
        sim.after_step()
        assert sim.stored_tensors() == 2  # one stashed version of each parameter, no kept gradient


def test_pipedream_tied_head_runs_at_lag_0_by_hand():
    """A weight used by stage 0 (embedding, p-1 versions stale) and by the last stage (tied head, current), as the
    executor's two copies: one gradient, the sum of both uses' at their own versions, applied to the one weight."""
    w, v = torch.nn.Parameter(torch.tensor([0.8], dtype=torch.float64)), torch.nn.Parameter(torch.tensor([-0.5], dtype=torch.float64))
    head = torch.nn.Module()
    head.weight = w  # the tied use on the last stage
    mid = torch.nn.Parameter(torch.tensor([0.3], dtype=torch.float64))
    opt = torch.optim.SGD([w, mid, v], lr=LR)
    sim = DelaySimulator("pipedream", [[w], [mid], [v]], lag0_uses=[(head, "weight")])
    f = lambda e, m, x, h: 0.5 * e * e * 1.3 + e * m + 0.7 * m * x + 0.4 * x * h + 0.9 * h * h * e  # e: embed use, h: head use
    traj = []
    for _ in range(STEPS):
        sim.before_forward()
        f(w[0], mid[0], v[0], head.weight[0]).backward()
        assert sim.after_backward() and head.weight is w
        opt.step()
        opt.zero_grad()
        sim.after_step()
        traj.append([w.item(), mid.item(), v.item()])
    W = [[0.8, 0.3, -0.5]]
    for t in range(STEPS):
        e, m, x, h = W[max(0, t - 2)][0], W[max(0, t - 1)][1], W[t][2], W[t][0]
        ge, gm, gx, gh = 1.3 * e + m + 0.9 * h * h, e + 0.7 * x, 0.7 * m + 0.4 * h, 0.4 * x + 1.8 * h * e
        W.append([W[t][0] - LR * (ge + gh), W[t][1] - LR * gm, W[t][2] - LR * gx])
    assert flat(traj) == pytest.approx(flat(W[1:]), rel=1e-12, abs=1e-12)
    untied = W[:1]  # the old simulation: the head as stale as the embedding; measurably different
    for t in range(STEPS):
        e, m, x = untied[max(0, t - 2)][0], untied[max(0, t - 1)][1], untied[t][2]
        ge, gm, gx, gh = 1.3 * e + m + 0.9 * e * e, e + 0.7 * x, 0.7 * m + 0.4 * e, 0.4 * x + 1.8 * e * e
        untied.append([untied[t][0] - LR * (ge + gh), untied[t][1] - LR * gm, untied[t][2] - LR * gx])
    assert flat(traj) != pytest.approx(flat(untied[1:]), rel=1e-6)
    assert DelaySimulator("1", [[w], [mid], [v]], lag0_uses=[(head, "weight")]).lag0_uses == []  # 2BW: all at lag 1


def test_keeps_only_the_versions_it_needs():
    params = [[torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))] for _ in range(4)]
    sim = DelaySimulator("pipedream", params)
    peak = 0
    for t in range(10):
        sim.before_forward()
        peak = max(peak, sim.stored_tensors())
        sim.after_backward()
        sim.after_step()
        for s in params:
            for q in s:
                q.data += 1.0  # a new version every step
    assert [len(h) for h in sim.history] == [3, 2, 1, 0]  # stage s keeps p-1-s old versions
    assert peak == 2 * (3 + 2 + 1)  # and no extra copy while the stale weights are in
    sim.before_forward()  # step 10: stage s computes with W[10-(3-s)] = 7+s, restored to 10 afterwards
    assert [s[0][0].item() for s in params] == [7.0, 8.0, 9.0, 10.0]
    sim.after_backward()
    assert all(q.eq(10.0).all() for s in params for q in s)


def test_protocol_and_config_errors():
    params = [[torch.nn.Parameter(torch.zeros(2))] for _ in range(2)]
    with pytest.raises(ValueError, match="simulate_delay: '2'"):
        DelaySimulator("2", params)
    with pytest.raises(ValueError, match="listed twice"):
        DelaySimulator("pipedream", [params[0], params[0]])
    sim = DelaySimulator("pipedream", params)
    with pytest.raises(RuntimeError, match="out of order"):
        sim.after_backward()
    with pytest.raises(ValueError, match="simulated stages"):
        DelaySimulator("pipedream", params + [[torch.nn.Parameter(torch.zeros(2))]]).load_state_dict(sim.state_dict())
    with pytest.raises(ValueError, match="simulate_delay '1'"):
        sim.load_state_dict({**DelaySimulator("1", params).state_dict()})


# ---------------------------------------------------------------- resume = straight


class Tiny(torch.nn.Module):
    """HF-like names so build_optimizer's hybrid grouping applies: embed, layers.N, norm, lm_head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.norm = torch.nn.LayerNorm(8)
        self.lm_head = torch.nn.Linear(8, 16, bias=False)

    def stages(self):
        e, (l0, l1, l2) = self.embed, self.layers
        return [[*e.parameters(), *l0.parameters()], list(l1.parameters()), [*l2.parameters(), *self.norm.parameters(),
                                                                             *self.lm_head.parameters()]]

    def forward(self, ids):
        h = self.embed(ids[:, :-1])
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(self.lm_head(self.norm(h)).flatten(0, 1), ids[:, 1:].flatten())


def _setup(name, mode):
    model = Tiny()
    cfg = OptimizerConfig(name=name, learning_rate=0.02, adamw_lr=0.01, delay_correction="error_feedback",
                          simulate_delay=mode)
    opt = apply_delay_correction(build_optimizer(model, cfg, log=lambda *_: None), cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0 / (1 + k))
    return model, opt, sched, DelaySimulator(mode, model.stages())


def _steps(parts, first, n):
    model, opt, sched, sim = parts
    losses = []
    for t in range(first, first + n):
        ids = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(t))
        sim.before_forward()
        loss = model(ids)
        loss.backward()
        if sim.after_backward():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
        opt.zero_grad()
        sim.after_step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", ["muon", "adamw"])
@pytest.mark.parametrize("mode", ["1", "pipedream"])
def test_resume_continues_exactly(name, mode):
    straight = _steps(_setup(name, mode), 0, 8)
    parts = _setup(name, mode)
    first = _steps(parts, 0, 4)
    model, opt, sched, sim = parts
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(), "delay": sim.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    fresh = _setup(name, mode)
    fresh[0].load_state_dict(saved["model"])
    fresh[1].load_state_dict(saved["opt"])
    fresh[2].load_state_dict(saved["sched"])
    fresh[3].load_state_dict(saved["delay"])
    assert fresh[1].error_feedback["prev"] and fresh[3].steps == 4
    rest = _steps(fresh, 4, 4)
    assert first + rest == straight
    assert len(set(straight)) == 8  # the losses move
