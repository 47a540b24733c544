"""The reinforcement-learning step shared by ``tests/graphs/test_rl_step.py`` (one process) and
``tests/parallel/test_rl_fsdp.py`` (FSDP2 on gloo ranks): the tiny transformers ``glm5_next`` model
patched in place under ``batch_invariant=True``, each decoder layer checkpointed and compiled with
Inductor (``fullgraph=True``, torchtitan's order), rollouts from the serving decoder
(``graphs.rollout.sample``) packed as one batch, group-normalised advantages and GRPO's clipped
surrogate."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from graphs.serving import SERVING_PRECISION
from inductor_ext import PrecisionConfig

__all__ = ["TRAIN", "SERVE", "SEQS", "PROMPT", "RESPONSE", "CLIP", "LR", "Rollouts", "rl_setup", "grpo_loss",
           "one_thread"]

TRAIN = PrecisionConfig.serving_aligned().replace(batch_invariant=True)
SERVE = SERVING_PRECISION.replace(batch_invariant=True)
SEQS, PROMPT, RESPONSE, CLIP, LR = 4, 8, 8, 0.2, 1e-4


@dataclass
class Rollouts:
    """``SEQS`` sampled sequences of ``PROMPT + RESPONSE`` tokens, their rollout log-probs
    ``[SEQS, RESPONSE]`` and advantages (the share of even token ids in the response, normalised
    over the group) ``[SEQS, RESPONSE]``."""

    seqs: torch.Tensor
    logp: torch.Tensor
    advantage: torch.Tensor

    def packed(self, rows=slice(None)):
        """Rows ``rows`` of the rollouts packed as one batch, padded to ``SEQS`` documents of the same
        length (token 0, targets -100: the packed shape of the whole batch, so every part of a
        batch runs the one compiled graph): ids ``[1, T]``, position_ids ``[1, T]`` (each sequence
        a document), targets ``[1, T]`` (the next token on the given rows' response positions, -100
        elsewhere)."""
        seqs = self.seqs[rows]
        n, L = seqs.shape
        targets = torch.full_like(self.seqs, -100)
        targets[:n, PROMPT - 1: L - 1] = seqs[:, PROMPT:]
        seqs = torch.cat([seqs, seqs.new_zeros(SEQS - n, L)])
        positions = torch.arange(L).expand(SEQS, L)
        return seqs.reshape(1, -1), positions.reshape(1, -1), targets.reshape(1, -1)

    def token_logprobs(self, model, rows=slice(None)) -> torch.Tensor:
        """The training model's log-probs of rows ``rows``' response tokens, ``[n, RESPONSE]``."""
        ids, positions, targets = self.packed(rows)
        logp = model.token_logprobs(ids, targets, position_ids=positions).reshape(SEQS, -1)
        n = self.seqs[rows].shape[0]
        return logp[:n][(targets != -100).reshape(SEQS, -1)[:n]].reshape(n, RESPONSE)


@contextlib.contextmanager
def one_thread():
    """torch at one thread inside, as the gloo ranks of ``tests/support/parallel.py``: Inductor's
    FX graph cache key holds the thread count its CPU kernels were generated for, so the one-process
    step and the ranks' step load each other's compiled layers instead of compiling them twice."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def grpo_loss(logp: torch.Tensor, rollout_logp: torch.Tensor, advantage: torch.Tensor) -> torch.Tensor:
    """GRPO's clipped importance-ratio surrogate, the mean over the given tokens."""
    ratio = (logp - rollout_logp).exp()
    return -torch.min(ratio * advantage, ratio.clamp(1 - CLIP, 1 + CLIP) * advantage).mean()


def rl_setup(seed: int = 0):
    """``(model, rollouts)``: the tiny transformers model patched under :data:`TRAIN` (indexer
    frozen), each decoder layer checkpointed then compiled (Inductor, ``fullgraph=True``), and
    ``SEQS`` rollouts sampled from a :class:`graphs.GLM53Model` copy of its weights under
    :data:`SERVE` (the same on every process: the generator is seeded)."""
    from graphs import GLM53Model, patch_transformers
    from graphs.rollout import sample
    from tests.support.hf import tiny_hf_model

    hf = tiny_hf_model()
    serving = GLM53Model.from_hf(hf, precision=TRAIN)  # the rollout engine's copy of the weights
    model = patch_transformers(hf, precision=TRAIN, freeze_indexer=True)
    layers = model.model.language_model.layers
    for i, layer in enumerate(layers):  # torchtitan's order: checkpoint, then compile each block
        layers.register_module(str(i), torch.compile(checkpoint_wrapper(layer), backend="inductor", fullgraph=True))
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, serving.config.vocab_size, (SEQS, PROMPT), generator=gen)
    seqs, rollout_logp = sample(serving, prompts, RESPONSE, generator=gen, precision=SERVE)
    reward = (seqs[:, PROMPT:] % 2 == 0).float().mean(1)
    advantage = ((reward - reward.mean()) / (reward.std() + 1e-6))[:, None].expand(SEQS, RESPONSE)
    return model, Rollouts(seqs, rollout_logp, advantage)
