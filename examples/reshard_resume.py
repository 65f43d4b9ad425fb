"""Resuming on another layout: a run saved under TP 2 x PP 2 goes on as TP 1 x PP 2, or dense, exactly.

A small GPT (the model and synthetic language of ``examples/muon_fsdp2.py``) is written with
Megatron-style tensor-parallel layers on plain tensors, as in ``examples/hybrid_parallel.py``: a
vocabulary-parallel embedding, column-parallel QKV, MLP-in and LM head, row-parallel projections,
replicated norms, position embeddings and row-parallel biases. The fused QKV weight keeps Megatron's
row order (each head's q, k and v rows together), so a tensor-parallel rank's heads are one
contiguous block of rows and its piece is a plain slice of the logical weight. The blocks are split
over pipeline stages. One ``ShardingSpec`` declares the layout, and ``gtx.partition`` sends the
blocks' 2-D weights to ``gradtx.contrib.muon`` (each rank's update is its slice of Muon on the whole
matrix) and everything else to AdamW, so every layout computes the same logical update.

The runs, over the same batches:

1. dense, one process, from start to end: the uninterrupted run;
2. TP 2 x PP 2 (4 ranks): halfway it saves its parameters and optimizer state with
   ``torch.distributed.checkpoint`` and goes on to the end;
3. TP 1 x PP 2 (2 ranks), resumed from that checkpoint;
4. TP 2 x PP 1 (2 ranks), resumed from it (the tensor-parallel pieces are cut again on load);
5. dense (one process), resumed from it.

The optimizer state is saved as the pieces of its logical tensors, keyed by logical state path, so
any layout can load it: ``gtx.checkpoint.state_dict(state, params, spec)`` gives the dict to save
(and, on the layout that resumes, the template to load into) and
``gtx.checkpoint.load_state_dict(state, loaded, params, spec)`` turns what was loaded into this
layout's state. The parameters travel beside it, each tensor-parallel piece a ``DTensor`` on the
``tp`` mesh.

The driver prints the loss curves side by side and checks two things. Every run's final parameters
equal the uninterrupted dense run's to float32 rounding (``TOLERANCE``): tensor parallelism sums
partial products in another order than one dense matmul does (the row-parallel all-reduce, the
column-parallel input gradients), and training carries those last-bit differences on, slowly (here
the largest reaches 4e-7 of a tensor's largest entry after the 6 quick steps, 6e-7 after 20 steps,
1.3e-6 after 40). And runs whose tensor parallelism is the same do the
same arithmetic, so from the same state they agree bit for bit: TP 1 x PP 2 resumed equals dense
resumed, and TP 2 x PP 1 resumed equals the TP 2 x PP 2 run it resumes. A checkpoint one bit off
anywhere fails that check.

Run:  python examples/reshard_resume.py [--quick] [--dir DIR]   (all the runs, then the comparison)

Each run is this script with ``--tp``/``--pp``; the driver starts them as these commands would
(forked from itself, so the ranks need not import torch again), e.g. for a checkpoint in DIR:

      torchrun --standalone --nproc_per_node 4 examples/reshard_resume.py --tp 2 --pp 2 --save DIR/checkpoint --out DIR/tp2_pp2.pt
      torchrun --standalone --nproc_per_node 2 examples/reshard_resume.py --tp 1 --pp 2 --resume DIR/checkpoint --out DIR/tp1_pp2.pt
      python examples/reshard_resume.py --tp 1 --pp 1 --resume DIR/checkpoint --out DIR/dense.pt

``--quick`` (or ``GRADTX_EXAMPLES_QUICK=1``): a tiny model and a few steps, as the tests run it.
"""

from __future__ import annotations

import argparse
import fnmatch
import gc
import multiprocessing
import os
import shlex
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard as DShard

import gradtx as gtx
from gradtx.contrib import muon
from gradtx.sharding import Replicate, Shard, ShardingSpec
from hybrid_parallel import Parallel  # Megatron's tensor-parallel communication (copy, reduce, gather)

QUICK = os.environ.get("GRADTX_EXAMPLES_QUICK") == "1" or "--quick" in sys.argv
if QUICK:
    VOCAB, CONTEXT, WIDTH, HEADS, MLP_HIDDEN, LAYERS, BATCH, STEPS = 32, 8, 16, 2, 32, 2, 4, 6
else:
    VOCAB, CONTEXT, WIDTH, HEADS, MLP_HIDDEN, LAYERS, BATCH, STEPS = 64, 16, 32, 4, 64, 4, 16, 20
HEAD_DIM = WIDTH // HEADS
SAVE_AT = STEPS // 2  # the checkpoint holds the run after this many steps
TOLERANCE = 1e-6  # largest relative difference of the final parameters from the uninterrupted run

# The layout, declared once: glob rules over parameter paths, first match wins; the rest is replicated.
RULES = [
    ("tokens.weight", Shard("tp", dim=0)),  # vocabulary-parallel embedding
    ("blocks.*.qkv.weight", Shard("tp", dim=0)),  # column-parallel, by heads
    ("blocks.*.fc1.*", Shard("tp", dim=0)),  # column-parallel (weight and bias)
    ("blocks.*.proj.weight", Shard("tp", dim=1)),  # row-parallel
    ("blocks.*.fc2.weight", Shard("tp", dim=1)),  # row-parallel
    ("head.weight", Shard("tp", dim=0)),  # column-parallel over the vocabulary; the logits are gathered
]


# --------------------------------------------------------------------------- the checkpoint API


def checkpoint_api() -> Any:
    """``gradtx.checkpoint``, the only gradtx API this script needs beyond the optimizers.

    ``state_dict(state, params, spec)``: the optimizer state as a flat dict keyed by logical state
    path, each leaf the pieces of its logical tensor (DTensors, chunked pieces, tensors), for
    ``dcp.save``, or, on the layout that resumes, the template ``dcp.load`` fills.
    ``load_state_dict(state, loaded, params, spec)``: the state of this layout, from a loaded dict.
    """
    try:
        from gradtx import checkpoint
    except ImportError as error:
        raise SystemExit(f"examples/reshard_resume.py needs gradtx.checkpoint, which this gradtx lacks ({error})") from None
    return checkpoint


# --------------------------------------------------------------------------- the layout


@dataclass
class Layout:
    """Where this rank sits: ``tp`` x ``pp`` ranks on a ``("pp", "tp")`` mesh, or dense (no mesh)."""

    tp: int
    pp: int
    mesh: Optional[DeviceMesh] = None
    spec: Optional[ShardingSpec] = None
    stage: int = 0
    tp_rank: int = 0

    def tp_comm(self) -> Parallel:
        return Parallel(self.mesh.get_group("tp") if self.tp > 1 else None)

    def peer(self, stage: int) -> int:
        """The global rank of this rank's tensor-parallel twin on ``stage``."""
        return int(self.mesh.mesh[stage, self.tp_rank])

    def holds(self, name: str) -> bool:
        """Whether this rank's stage holds parameter ``name``."""
        if name.startswith("blocks."):
            return int(name.split(".")[1]) * self.pp // LAYERS == self.stage
        return self.stage == (0 if name.startswith(("tokens.", "positions.")) else self.pp - 1)

    def blocks(self) -> range:
        per_stage = LAYERS // self.pp
        return range(self.stage * per_stage, (self.stage + 1) * per_stage)


def make_layout(tp: int, pp: int) -> Layout:
    if LAYERS % pp or HEADS % tp or VOCAB % tp or MLP_HIDDEN % tp:
        raise SystemExit(f"TP {tp} x PP {pp} does not divide {LAYERS} blocks, {HEADS} heads, {VOCAB} tokens, {MLP_HIDDEN} hidden units")
    if tp * pp == 1 and not dist.is_initialized():
        return Layout(1, 1)
    if dist.get_world_size() != tp * pp:
        raise SystemExit(f"TP {tp} x PP {pp} needs {tp * pp} ranks, not {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
    stage, tp_rank = mesh.get_coordinate()
    return Layout(tp, pp, mesh, ShardingSpec(mesh, RULES, stage_axis="pp", default=Replicate()), stage, tp_rank)


def split_dim(name: str) -> Optional[int]:
    """The dim tensor parallelism splits parameter ``name`` along (``None``: replicated)."""
    for pattern, leaf_spec in RULES:
        if fnmatch.fnmatchcase(name, pattern):
            return leaf_spec.dims[0]
    return None


def local_params(dense: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """This rank's pieces of the logical parameters: its stage's, cut as ``RULES`` says."""
    local = {}
    for name, x in dense.items():
        if layout.holds(name):
            dim = split_dim(name)
            local[name] = (x if dim is None else x.chunk(layout.tp, dim)[layout.tp_rank]).clone()
    return local


# --------------------------------------------------------------------------- the model


def dense_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """The logical model: embeddings, ``LAYERS`` pre-norm blocks, a final norm and an LM head."""
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen) / cols**0.5

    def vector(size: int, mean: float = 0.0) -> torch.Tensor:  # norms and biases
        return mean + 0.1 * torch.randn(size, generator=gen)

    params = {"tokens.weight": torch.randn(VOCAB, WIDTH, generator=gen), "positions.weight": torch.randn(CONTEXT, WIDTH, generator=gen)}
    for i in range(LAYERS):
        p = f"blocks.{i}."
        params.update(
            {
                p + "ln1.weight": vector(WIDTH, 1.0),
                p + "ln1.bias": vector(WIDTH),
                # rows ordered (head, q/k/v, head dim), as Megatron's fused QKV; no bias, whose key part
                # would get an exactly-zero gradient (softmax ignores it) that Adam turns into noise
                p + "qkv.weight": linear(3 * WIDTH, WIDTH),
                p + "proj.weight": linear(WIDTH, WIDTH),
                p + "proj.bias": vector(WIDTH),
                p + "ln2.weight": vector(WIDTH, 1.0),
                p + "ln2.bias": vector(WIDTH),
                p + "fc1.weight": linear(MLP_HIDDEN, WIDTH),
                p + "fc1.bias": vector(MLP_HIDDEN),
                p + "fc2.weight": linear(WIDTH, MLP_HIDDEN),
                p + "fc2.bias": vector(WIDTH),
            }
        )
    params.update({"ln_f.weight": vector(WIDTH, 1.0), "ln_f.bias": vector(WIDTH), "head.weight": linear(VOCAB, WIDTH)})
    return params


def embed(params, ids: torch.Tensor, tp: Parallel, layout: Layout) -> torch.Tensor:
    """Token and position embeddings; under TP each rank looks up the ids in its slice of the vocabulary."""
    weight = params["tokens.weight"]
    if tp.group is None:
        x = F.embedding(ids, weight)
    else:
        start = layout.tp_rank * weight.shape[0]
        mine = (ids >= start) & (ids < start + weight.shape[0])
        x = tp.reduce(F.embedding(torch.where(mine, ids - start, 0), weight) * mine.unsqueeze(-1))
    return x + params["positions.weight"][: ids.shape[1]]


def block(params, i: int, x: torch.Tensor, tp: Parallel) -> torch.Tensor:
    """Pre-norm causal self-attention over this rank's heads, then the MLP over its hidden units."""
    p = f"blocks.{i}."
    b, t, _ = x.shape
    h = F.layer_norm(x, (WIDTH,), params[p + "ln1.weight"], params[p + "ln1.bias"])
    qkv = F.linear(tp.copy(h), params[p + "qkv.weight"])
    q, k, v = qkv.view(b, t, -1, 3, HEAD_DIM).permute(3, 0, 2, 1, 4)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
    x = x + tp.reduce(F.linear(attended, params[p + "proj.weight"])) + params[p + "proj.bias"]
    h = F.layer_norm(x, (WIDTH,), params[p + "ln2.weight"], params[p + "ln2.bias"])
    h = F.gelu(F.linear(tp.copy(h), params[p + "fc1.weight"], params[p + "fc1.bias"]))
    return x + tp.reduce(F.linear(h, params[p + "fc2.weight"])) + params[p + "fc2.bias"]


def head_loss(params, x: torch.Tensor, targets: torch.Tensor, tp: Parallel) -> torch.Tensor:
    x = F.layer_norm(x, (WIDTH,), params["ln_f.weight"], params["ln_f.bias"])
    logits = tp.gather(F.linear(tp.copy(x), params["head.weight"]))
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def batch(step: int) -> torch.Tensor:
    """Step ``step``'s sequences: a random first token, then ``next = (5 * token + 3) % VOCAB``.

    Seeded by the step, so a resumed run reads the batches the uninterrupted one does.
    """
    tokens = [torch.randint(0, VOCAB, (BATCH,), generator=torch.Generator().manual_seed(1000 + step))]
    for _ in range(CONTEXT):
        tokens.append((5 * tokens[-1] + 3) % VOCAB)
    return torch.stack(tokens, dim=1)


def gradients(params, tokens: torch.Tensor, layout: Layout) -> tuple[dict[str, torch.Tensor], Optional[torch.Tensor]]:
    """Forward and backward of one batch through the stages; this rank's gradients, and the loss on
    the last stage (``None`` elsewhere)."""
    tp = layout.tp_comm()
    params = {k: v.detach().requires_grad_() for k, v in params.items()}
    first, last = layout.stage == 0, layout.stage == layout.pp - 1
    if first:
        x = embed(params, tokens[:, :-1], tp, layout)
    else:
        x = torch.empty(BATCH, CONTEXT, WIDTH)
        dist.recv(x, src=layout.peer(layout.stage - 1))
        x.requires_grad_()
    out = x
    for i in layout.blocks():
        out = block(params, i, out, tp)
    loss = None
    if last:
        loss = head_loss(params, out, tokens[:, 1:], tp)
        loss.backward()
    else:
        dist.send(out.detach().contiguous(), dst=layout.peer(layout.stage + 1))
        grad_out = torch.empty_like(out)
        dist.recv(grad_out, src=layout.peer(layout.stage + 1))
        out.backward(grad_out)
    if not first:
        dist.send(x.grad.contiguous(), dst=layout.peer(layout.stage - 1))
    return {k: v.grad for k, v in params.items()}, None if loss is None else loss.detach()


def optimizer(params: dict[str, torch.Tensor], spec: Optional[ShardingSpec]) -> gtx.GradientTransformation:
    """Muon for the blocks' matrices, AdamW for embeddings, the LM head, norms and biases."""
    labels = {name: "muon" if name.startswith("blocks.") and x.ndim == 2 else "adamw" for name, x in params.items()}
    return gtx.partition(
        {"muon": muon(learning_rate=0.02, weight_decay=0.01, spec=spec), "adamw": gtx.adamw(3e-3, weight_decay=0.01)},
        labels,
    )


# --------------------------------------------------------------------------- checkpoints


def model_state_dict(params: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """Copies of the parameters as DCP sees them: a tensor-parallel piece as a ``DTensor`` on the
    ``tp`` mesh (its place in the logical tensor), anything whole as a plain tensor."""
    out = {}
    for name, x in params.items():
        dim = split_dim(name)
        x = x.clone()
        if dim is not None and layout.tp > 1:
            x = DTensor.from_local(x, layout.mesh["tp"], [DShard(dim)], run_check=False)
        out[name] = x
    return out


def save(path: str, step: int, params, state, layout: Layout) -> None:
    optim = checkpoint_api().state_dict(state, params, layout.spec)
    dcp.save({"step": torch.tensor(step), "model": model_state_dict(params, layout), "optim": optim}, checkpoint_id=path)


def load(path: str, params, state, layout: Layout) -> tuple[int, dict[str, torch.Tensor], Any]:
    """The step, parameters and optimizer state saved at ``path``, laid out for ``layout``;
    ``params`` and ``state`` (freshly initialised on this layout) give the shapes to load into."""
    api = checkpoint_api()
    loaded = {"step": torch.tensor(0), "model": model_state_dict(params, layout), "optim": api.state_dict(state, params, layout.spec)}
    with warnings.catch_warnings():  # a dense run loads in one process, as it means to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(loaded, checkpoint_id=path)
    params = {name: x.to_local() if isinstance(x, DTensor) else x for name, x in loaded["model"].items()}
    return int(loaded["step"]), params, api.load_state_dict(state, loaded["optim"], params, layout.spec)


# --------------------------------------------------------------------------- one run


def run(layout: Layout, save_to: Optional[str] = None, resume_from: Optional[str] = None) -> Optional[dict]:
    """Trains on ``layout`` to step ``STEPS``; returns (on global rank 0) the losses by step and the
    final logical parameters of the whole model."""
    params = local_params(dense_params(), layout)
    tx = optimizer(params, layout.spec)
    state = tx.init(params)
    start = 0
    if resume_from is not None:
        start, params, state = load(resume_from, params, state, layout)
    losses = {}
    for step in range(start, STEPS):
        grads, loss = gradients(params, batch(step), layout)
        updates, state = tx.update(grads, state, params)
        params = gtx.apply_updates(params, updates)
        if loss is not None:
            losses[step] = float(loss)
        if save_to is not None and step + 1 == SAVE_AT:
            save(save_to, step + 1, params, state, layout)
    return gather_to_rank0(losses, params, layout)


def gather_to_rank0(losses: dict[int, float], params, layout: Layout) -> Optional[dict]:
    """The losses and the whole logical parameters, on global rank 0 (pieces joined over ``tp``,
    stages collected); ``None`` elsewhere."""
    if layout.mesh is None:
        return {"losses": losses, "params": params}
    whole = {}
    for name, x in params.items():
        dim = split_dim(name)
        if dim is not None and layout.tp > 1:
            pieces = [torch.empty_like(x) for _ in range(layout.tp)]
            dist.all_gather(pieces, x.contiguous(), group=layout.mesh.get_group("tp"))
            x = torch.cat(pieces, dim)
        whole[name] = x
    mine = {"losses": losses, "params": whole} if layout.tp_rank == 0 else {"losses": {}, "params": {}}
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if dist.get_rank() != 0:
        return None
    return {key: {k: v for part in gathered for k, v in part[key].items()} for key in ("losses", "params")}


def worker(args: argparse.Namespace, init_method: Optional[str] = None, rank: int = -1, world_size: int = -1) -> int:
    """One run (``--tp``/``--pp``/``--save``/``--resume``/``--out``) on this process's rank: of the
    torchrun world, of the world the driver forked (``init_method``), or alone (dense)."""
    torch.set_num_threads(1)
    if init_method is not None or "RANK" in os.environ:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    if args.save or args.resume:
        checkpoint_api()  # fail before training when the API is missing
    result = run(make_layout(args.tp, args.pp), save_to=args.save, resume_from=args.resume)
    if result is not None and args.out:
        torch.save(result, args.out)
    return 0


# --------------------------------------------------------------------------- the driver


def launch(nproc: int, argv: list[str], workdir: Path) -> None:
    """Runs ``argv`` as the command shown would: on ``nproc`` ranks, forked from this process (which
    has imported everything already, so the ranks start in a moment), or here when ``nproc`` is 1."""
    script = os.path.relpath(__file__)
    launcher = ["torchrun", "--standalone", "--nproc_per_node", str(nproc)] if nproc > 1 else ["python"]
    print("$", shlex.join([*launcher, script, *argv]), flush=True)
    args = parser().parse_args(argv)
    if nproc == 1:
        worker(args)
        return
    store = workdir / f"store-{nproc}-{uuid.uuid4().hex}"  # the ranks meet in this file
    context = multiprocessing.get_context("fork")
    ranks = [context.Process(target=_rank, args=(args, f"file://{store}", rank, nproc)) for rank in range(nproc)]
    for process in ranks:
        process.start()
    while any(process.is_alive() for process in ranks):  # a rank that fails stops the others
        if any(process.exitcode not in (None, 0) for process in ranks):
            for process in ranks:
                process.terminate()
        time.sleep(0.05)
    store.unlink(missing_ok=True)
    failed = {rank: process.exitcode for rank, process in enumerate(ranks) if process.exitcode != 0}
    if failed:
        raise SystemExit(f"{shlex.join(argv)}: ranks {failed} failed (rank: exit code)")


def _rank(args: argparse.Namespace, store: str, rank: int, world_size: int) -> None:
    status = worker(args, store, rank, world_size)
    shutdown()
    sys.exit(status)


def relative_difference(params: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    """The largest, over parameters, of ``max |p - ref| / max |ref|``."""
    if params.keys() != reference.keys():
        raise ValueError(f"the runs hold different parameters: {sorted(params.keys() ^ reference.keys())}")
    return max(float((params[k] - reference[k]).abs().max() / reference[k].abs().max()) for k in reference)


def same_run(a: dict, b: dict) -> bool:
    """Whether two runs' losses (over the steps both took) and final parameters are bit for bit equal."""
    steps = a["losses"].keys() & b["losses"].keys()
    return all(a["losses"][s] == b["losses"][s] for s in steps) and all(torch.equal(a["params"][k], b["params"][k]) for k in b["params"])


def drive(workdir: Path) -> int:
    checkpoint_api()  # say at once when the API is missing
    ckpt = str(workdir / "checkpoint")
    torch.set_num_threads(1)
    print(f"GPT: {LAYERS} blocks of width {WIDTH}, {HEADS} heads, vocabulary {VOCAB}; {STEPS} steps, checkpoint after step {SAVE_AT}")
    runs = {  # the forked worlds first, while this process has computed nothing yet
        "TP2 x PP2": (4, ["--tp", "2", "--pp", "2", "--save", ckpt]),
        "TP1 x PP2, resumed": (2, ["--tp", "1", "--pp", "2", "--resume", ckpt]),
        "TP2 x PP1, resumed": (2, ["--tp", "2", "--pp", "1", "--resume", ckpt]),
        "dense, resumed": (1, ["--tp", "1", "--pp", "1", "--resume", ckpt]),
    }
    results = {}
    for i, (name, (nproc, argv)) in enumerate(runs.items()):
        out = str(workdir / f"run{i}.pt")
        launch(nproc, [*argv, "--out", out, *(["--quick"] if QUICK else [])], workdir)
        results[name] = torch.load(out)
    results = {"dense": run(Layout(1, 1)), **results}

    print("\nloss by step (resumed runs start from the checkpoint)")
    print(f"{'step':>4} " + "".join(f"{name:>20}" for name in results))
    for step in range(STEPS):
        row = [f"{r['losses'][step]:20.6f}" if step in r["losses"] else " " * 20 for r in results.values()]
        print(f"{step:4d} " + "".join(row) + ("   <- checkpoint" if step + 1 == SAVE_AT else ""))
    worst = 0.0
    print("\nfinal parameters against the uninterrupted dense run (largest max|p - ref| / max|ref| over tensors):")
    for name, result in list(results.items())[1:]:
        difference = relative_difference(result["params"], results["dense"]["params"])
        worst = max(worst, difference)
        print(f"  {name:20s} {difference:.2e}")
    # Layouts with the same tensor parallelism do the same arithmetic, so from the same state they agree bit
    # for bit: a resumed run then equals, exactly, the run it resumes or its dense twin.
    exact = {
        "TP2 x PP1, resumed = TP2 x PP2 (uninterrupted)": same_run(results["TP2 x PP1, resumed"], results["TP2 x PP2"]),
        "TP1 x PP2, resumed = dense, resumed": same_run(results["TP1 x PP2, resumed"], results["dense, resumed"]),
    }
    for claim, holds in exact.items():
        print(f"bit for bit: {claim}: {holds}")
    ok = worst <= TOLERANCE and all(exact.values())
    print("every resumed run matches the uninterrupted one" if ok else f"MISMATCH (tolerance {TOLERANCE:.0e})")
    return 0 if ok else 1


def shutdown() -> None:
    """Leaves the process group cleanly: every rank waits for the others, then the group goes."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        gc.collect()
        dist.destroy_process_group()


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model and a few steps")
    parser.add_argument("--dir", help="where the driver keeps the checkpoint and results (default: a temporary folder)")
    parser.add_argument("--tp", type=int, help="one run: tensor-parallel ranks")
    parser.add_argument("--pp", type=int, help="one run: pipeline stages")
    parser.add_argument("--save", help="one run: save a checkpoint here after step STEPS // 2")
    parser.add_argument("--resume", help="one run: resume from the checkpoint here")
    parser.add_argument("--out", help="one run: write the losses and final parameters here (torch.save)")
    return parser


def main() -> int:
    args = parser().parse_args()
    if args.tp is not None or args.pp is not None:
        args.tp, args.pp = args.tp or 1, args.pp or 1
        return worker(args)
    if args.dir:
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        return drive(Path(args.dir))
    with tempfile.TemporaryDirectory(prefix="reshard_resume_") as workdir:
        return drive(Path(workdir))


if __name__ == "__main__":
    status = main()
    shutdown()
    raise SystemExit(status)
