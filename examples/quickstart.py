"""Train a small classifier functionally with a gradtx chain that clips, logging the gradient norm."""

from __future__ import annotations

import torch

import gradtx as gtx


def main() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    inputs = torch.randn(256, 16)
    labels = (inputs[:, :3] * 3).argmax(dim=1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss_fn(p, x, y):
        logits = torch.func.functional_call(model, p, (x,))
        return torch.nn.functional.cross_entropy(logits, y)

    tx = gtx.chain(gtx.clip_by_global_norm(1.0), gtx.stateless_with_tree_map(lambda g: -0.5 * g))
    state = tx.init(params)
    for step in range(101):
        grads = torch.func.grad(loss_fn)(params, inputs, labels)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        if step % 20 == 0:
            loss = loss_fn(params, inputs, labels).item()
            print(f"step {step:3d}  loss {loss:.4f}  grad norm before clipping {state[0].norm.item():.4f}")


if __name__ == "__main__":
    main()
