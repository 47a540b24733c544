"""One reinforcement-learning step as a trainer runs it, on the tiny preset with
``batch_invariant=True``: rollouts from the serving decoder (``graphs.rollout.sample``: prompts,
sampled responses, rollout log-probs), the training forward of a transformers glm5_next model
patched in place (``graphs.patch_transformers``; each decoder layer checkpointed, then compiled with
Inductor and ``fullgraph=True``, torchtitan's order) computing ``token_logprobs`` of the packed
sequences (documents by ``position_ids``), a GRPO-style clipped importance-ratio loss, backward and
optimizer steps. The train/rollout log-prob difference is exactly 0 for every response token, and
the surrogate loss falls over four optimizer steps (Adam, lr 1e-4; measured 0, -0.057, -0.091,
-0.110) on the batch.
"""

import pytest
import torch

import inductor_ext

pytest.importorskip("transformers")
from tests.support.rl import LR, RESPONSE, SEQS, grpo_loss, one_thread, rl_setup  # noqa: E402


@pytest.fixture(scope="module")
def rl_run():
    inductor_ext.enable()
    torch._dynamo.reset()
    with one_thread():  # the compiled layers are then those of tests/parallel/test_rl_fsdp.py's ranks
        model, rollouts = rl_setup()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=LR)
        losses, diffs = [], None
        for _ in range(4):
            logp = rollouts.token_logprobs(model)
            if diffs is None:
                diffs = (logp.detach() - rollouts.logp).abs()
            loss = grpo_loss(logp, rollouts.logp, rollouts.advantage)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return diffs, losses, params


def test_train_and_rollout_logprobs_agree_bitwise(rl_run):
    diffs, _, _ = rl_run
    assert diffs.shape == (SEQS, RESPONSE)
    assert int((diffs != 0).sum()) == 0, f"{int((diffs != 0).sum())} tokens differ, max {diffs.max().item():.3g}"


def test_the_surrogate_loss_falls(rl_run):
    _, losses, params = rl_run
    print("GRPO surrogate loss per optimizer step:", [f"{x:.4f}" for x in losses])
    assert losses[0] == pytest.approx(0.0, abs=1e-5)  # ratio 1 on the rollout's own policy, centred advantages
    assert all(b < a for a, b in zip(losses, losses[1:])), losses
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in params)
