"""A wrapped optimizer inside Hugging Face ``Trainer``, single process, CPU, a tiny random-init model.

``Trainer(optimizers=(wrap(AdamW, clip_by_global_norm), scheduler), max_grad_norm=0)`` must train
as a plain torch loop with ``clip_grad_norm_`` does (Trainer's own clipping off: one clip, not two),
and a run resumed from one of Trainer's checkpoints (``resume_from_checkpoint``, which saves and
loads ``optimizer.state_dict()``) must end where the uninterrupted run does, bit for bit, with a
chain whose state changes the numbers (a scheduled scale before SGD with momentum).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import gradtx as gtx  # noqa: E402
from _lazy import lazy_or_skip  # noqa: E402
from _loops import accumulate_then_clip_and_step  # noqa: E402

transformers = lazy_or_skip("transformers")

SAMPLES = 8  # one batch of all samples per step: the step's loss does not depend on the sample order
STEPS = 6
MAX_NORM = 0.1


class TinyClassifier(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(x)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def dataset() -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(SAMPLES, 6, generator=gen), torch.randint(0, 3, (SAMPLES,), generator=gen)
    return [{"x": x[i], "labels": y[i]} for i in range(SAMPLES)]


def arguments(output_dir, **overrides) -> "transformers.TrainingArguments":
    options = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=SAMPLES,
        max_steps=STEPS,
        max_grad_norm=0.0,  # gradtx clips; Trainer must not clip again
        use_cpu=True,
        report_to=[],
        logging_strategy="no",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    options.update(overrides)
    return transformers.TrainingArguments(**options)


def linear_decay(step: int) -> float:
    return 1.0 - step / 10


def test_trainer_with_a_wrapped_optimizer_matches_a_plain_loop_with_clip_grad_norm(tmp_path):
    model = TinyClassifier()
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2), gtx.clip_by_global_norm(MAX_NORM), model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay)
    trainer = transformers.Trainer(
        model=model, args=arguments(tmp_path), train_dataset=dataset(), optimizers=(opt, sched)
    )
    trainer.train()

    reference = TinyClassifier()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, linear_decay)
    batch = dataset()
    x, y = torch.stack([b["x"] for b in batch]), torch.stack([b["labels"] for b in batch])
    clipped = []
    for _ in range(STEPS):
        ref_opt.zero_grad()
        reference(x, y)["loss"].backward()
        clipped.append(float(torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)) > MAX_NORM)
        ref_opt.step()
        ref_sched.step()
    assert any(clipped), "the clip never engaged: the comparison would not see a second clip"
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    for p, q in zip(model.parameters(), reference.parameters()):
        # Trainer sees the batch in its sampler's order: the loss's sum may round differently
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def make_stateful(model: nn.Module):
    scheduled = gtx.inject_hyperparams(gtx.scale)(step_size=gtx.linear_schedule(1.0, 0.2, STEPS))
    opt = gtx.wrap(
        torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
        gtx.chain(gtx.clip_by_global_norm(MAX_NORM), scheduled),
        model=model,
    )
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, linear_decay)


def test_trainer_resume_from_checkpoint_equals_the_uninterrupted_run(tmp_path):
    model = TinyClassifier()
    args = arguments(tmp_path / "first", save_strategy="steps", save_steps=3)
    transformers.Trainer(model=model, args=args, train_dataset=dataset(), optimizers=make_stateful(model)).train()
    checkpoint = tmp_path / "first" / "checkpoint-3"
    assert (checkpoint / "optimizer.pt").exists()

    resumed = TinyClassifier(seed=7)
    opt, sched = make_stateful(resumed)
    trainer = transformers.Trainer(
        model=resumed, args=arguments(tmp_path / "second"), train_dataset=dataset(), optimizers=(opt, sched)
    )
    trainer.train(resume_from_checkpoint=str(checkpoint))
    assert int(opt.tx_state[1].count) == STEPS  # the schedule's counter came back with the checkpoint
    for p, q in zip(resumed.parameters(), model.parameters()):
        assert torch.equal(p, q)


def poison_gradient(at: int) -> "transformers.TrainerCallback":
    """A callback that puts a NaN in one gradient just before the optimizer step of Trainer's step ``at``."""

    class PoisonGradient(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            if state.global_step == at:
                kwargs["model"].net[0].weight.grad[0, 0] = float("nan")

    return PoisonGradient()


ACCUMULATE = 2
NAN_STEP = 2  # a mini-step: its window's applied step is dropped


def test_trainer_with_multisteps_and_apply_if_finite_inside_wrap_matches_a_plain_loop(tmp_path):
    """Skipped steps skip AdamW (momentum, weight decay, its step count), as in the plain loop that
    accumulates by hand and skips a window holding a NaN."""
    model = TinyClassifier()
    tx = gtx.MultiSteps(gtx.apply_if_finite(gtx.clip_by_global_norm(MAX_NORM), 3), ACCUMULATE)
    opt = gtx.wrap(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1), tx, model=model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = transformers.Trainer(
        model=model,
        args=arguments(tmp_path),
        train_dataset=dataset(),
        optimizers=(opt, sched),
        callbacks=[poison_gradient(NAN_STEP)],
    )
    trainer.train()

    reference = TinyClassifier()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    batch = dataset()
    x, y = torch.stack([b["x"] for b in batch]), torch.stack([b["labels"] for b in batch])
    acc = [torch.zeros_like(p) for p in reference.parameters()]
    for step in range(STEPS):
        reference.zero_grad()
        reference(x, y)["loss"].backward()
        if step == NAN_STEP:
            reference.net[0].weight.grad[0, 0] = float("nan")
        accumulate_then_clip_and_step(list(reference.parameters()), acc, step, ACCUMULATE, ref_opt, MAX_NORM)
    applied = STEPS // ACCUMULATE - 1
    assert int(opt.optimizer.state[model.net[0].weight]["step"]) == applied
    assert int(ref_opt.state[reference.net[0].weight]["step"]) == applied
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
