"""`load`: read a checkpoint saved at any world size and stage into the layout of `like`
(`specs/checkpoint-format.md` §Loading): each rank reads only the elements it holds, from
whichever ranks' segments overlap them, and zeroes the padding; no conversion step.
"""

from __future__ import annotations

import bisect
import contextlib
import os
from typing import Any

import torch

from .._errors import CheckpointError
from .._state import LossScaleState, TrainState
from ..sharding import ShardSource, is_placeholder, sources_of
from . import _format as F
from ._io import prefer_huge_pages, read_into
from ._safe import entry_kind, is_real_dir, is_real_file, open_dir, open_file, read_small
from ._tp import fill_tp_leaf, tp_check_view
from ._by_name import fill_by_name, same_units, saved_slots, stored_key
from ._frozen import fill_frozen
from ._ep import check_ep_supported, ep_check_view, expert_places
from ._same_model import check_model, mismatch, shape_of
from ._per_rank import read_per_rank_leaf
from ._tree import Leaf, rebuild_state, unit_meta

__all__ = ["load", "Reader", "resolve", "list_tags", "read_latest", "rebuild_into_constants"]


def list_tags(root: str) -> list[str]:
    """Committed checkpoints under `root` (real directories holding an index; a link is not a
    checkpoint of this directory), oldest first."""
    out = []
    try:
        names = os.listdir(root)
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint directory {root!r}: {e.strerror}") from None
    for name in names:
        p = os.path.join(root, name)
        if not name.startswith(".") and is_real_dir(p) and is_real_file(os.path.join(p, F.INDEX_NAME)):
            out.append((os.stat(os.path.join(p, F.INDEX_NAME), follow_symlinks=False).st_mtime, name))
    return [n for _, n in sorted(out)]


def read_latest(root: str, root_fd: int | None = None, name: str = F.LATEST_NAME) -> str | None:
    """The tag `root/latest` names (None when there is no `latest`), read as an untrusted file:
    a regular file of at most 1 KiB holding a valid tag. Messages never quote its contents.
    `root_fd`: the root's open descriptor, when the caller holds one. `name`: another file of the
    same kind (DeepSpeed's `latest_universal`)."""
    lp = os.path.join(root, name)
    fd = open_dir(root, None, root) if root_fd is None else root_fd
    try:
        raw = read_small(name, fd, lp, F.MAX_LATEST_BYTES)
    except FileNotFoundError:
        return None
    finally:
        if root_fd is None:
            os.close(fd)
    try:
        return F.check_tag(raw.decode("ascii").strip())
    except (UnicodeDecodeError, CheckpointError):
        raise CheckpointError(f"{lp} does not hold a checkpoint tag ({len(raw)} bytes that are not one)") from None


def resolve(path: str | os.PathLike, tag: str | None = None) -> str:
    """The directory of checkpoint `tag` under `path` (default: the tag named by `path/latest`).
    `path` may also be a checkpoint directory itself. `path` is the caller's and may be a link;
    nothing below it is followed (`_safe.py`)."""
    root = os.path.abspath(os.fspath(path))
    if tag is None and entry_kind(os.path.join(root, F.INDEX_NAME)) is not None:
        return root
    try:
        root_fd = open_dir(root, None, root)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint directory at {root!r}") from None
    try:
        if tag is None:
            tag = read_latest(root, root_fd)
            if tag is None:
                raise CheckpointError(f"{root!r} has no 'latest' file; pass tag= (tags here: {list_tags(root)})")
        else:
            F.check_tag(tag)
        kind = entry_kind(tag, root_fd)
        if kind == "a directory":
            return os.path.join(root, tag)
        if kind is not None:
            raise CheckpointError(f"checkpoint {tag!r} under {root!r} is {kind}; fnzero follows no links inside "
                                  "a checkpoint directory")
        # A save that replaced this tag died between moving the old copy aside and renaming the new in.
        old = sorted(n for n in os.listdir(root_fd) if n.startswith(f".{tag}.") and n.endswith(".old"))
        if old:
            if not is_real_dir(old[-1], root_fd):
                raise CheckpointError(f"{os.path.join(root, old[-1])} is {entry_kind(old[-1], root_fd)}, not a "
                                      "checkpoint directory")
            return os.path.join(root, old[-1])
        raise CheckpointError(f"checkpoint {tag!r} not found under {root!r} (tags here: {list_tags(root)})")
    finally:
        os.close(root_fd)


class Reader(contextlib.AbstractContextManager):
    """A validated index plus range reads (checksummed) from the rank data files. Every file is
    opened relative to the checkpoint directory's descriptor, as a regular file, never through a
    link (`_safe.py`); sizes are checked against the index before anything is read."""

    def __init__(self, ckpt_dir: str, verify: bool = True):
        self.dir = ckpt_dir
        self.verify = verify
        self._fds: dict[int, int] = {}
        try:
            self._dir_fd = open_dir(ckpt_dir, None, ckpt_dir)
        except FileNotFoundError:
            raise CheckpointError(f"no checkpoint directory at {ckpt_dir!r}") from None
        try:
            self._open_index()
        except BaseException:
            os.close(self._dir_fd)
            raise

    def _open_index(self) -> None:
        p = os.path.join(self.dir, F.INDEX_NAME)
        try:
            raw = read_small(F.INDEX_NAME, self._dir_fd, p, F.MAX_INDEX_BYTES)
        except FileNotFoundError:
            raise CheckpointError(f"{self.dir!r} has no {F.INDEX_NAME}: not a committed checkpoint") from None
        ix = F.unpack(raw, p)
        sizes = {}
        files = ix.get("files") if isinstance(ix, dict) else None
        for r in range(len(files) if isinstance(files, list) and len(files) <= (1 << 20) else 0):
            name = F.data_name(r)
            kind = entry_kind(name, self._dir_fd)
            if kind == "a regular file":
                sizes[r] = os.stat(name, dir_fd=self._dir_fd, follow_symlinks=False).st_size
            elif kind is not None:
                raise CheckpointError(f"{os.path.join(self.dir, name)} is {kind}, not a regular file; fnzero "
                                      "follows no links inside a checkpoint directory")
        self.index = F.validate_index(ix, sizes)
        self.present = set(sizes)  # ranks whose data file is here (a node-local save: this node's)
        self.tensors = self.index["tensors"]
        self._his = {k: [s[3] for s in t["segments"]] for k, t in self.tensors.items()}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __exit__(self, *exc):
        self.close()

    def _fd(self, rank: int) -> int:
        fd = self._fds.get(rank)
        if fd is None:
            where = os.path.join(self.dir, F.data_name(rank))
            try:
                fd, size = open_file(F.data_name(rank), self._dir_fd, where)
            except FileNotFoundError:
                raise CheckpointError(self._missing(rank, where)) from None
            if size != self.index["files"][rank]:
                os.close(fd)
                raise CheckpointError(f"{where} is {size} bytes, the index says {self.index['files'][rank]}: "
                                      "replaced while it was read")
            self._fds[rank] = fd
        return fd

    def _missing(self, rank: int, where: str) -> str:
        groups = (self.index.get("node_local") or {}).get("groups")
        if not groups:
            return f"data file {where} of rank {rank} is missing"
        group = next(g for g in groups if rank in g)
        return (
            f"data file {where} of rank {rank} is not here: this checkpoint was saved node-locally "
            f"(checkpoint.use_node_local_storage), and rank {rank}'s files are on the node of ranks {group}. Loading "
            f"at the saving world size ({self.index['world_size']}) and stage reads only each node's own files; to "
            f"load another layout, first copy every node's {os.path.basename(self.dir)}/rank*.bin into this directory"
        )

    def dtype(self, key: str) -> torch.dtype:
        return F.DTYPES[self.tensors[key]["dtype"]]

    def read(self, key: str, a: int, b: int, out: torch.Tensor) -> torch.Tensor:
        """Fill 1-D contiguous CPU `out` (any dtype; cast on copy) with elements [a, b) of `key`.
        Each segment's checksum is computed while the next segment is read, and all are checked
        before this returns."""
        t = self.tensors[key]
        dt = F.DTYPES[t["dtype"]]
        segs = t["segments"]
        i = bisect.bisect_right(self._his[key], a)
        pending = []
        try:
            while i < len(segs) and segs[i][2] < b:
                rank, off, lo, hi, crc = segs[i]
                x, y = max(a, lo), min(b, hi)
                dst = out[x - a : y - a]
                what = f"{F.data_name(rank)} segment {key!r}[{lo}:{hi}]"
                if x == lo and y == hi and dst.dtype == dt:
                    got = read_into(self._fd(rank), off, dst, what, checksum=self.verify, wait=False)
                else:
                    scratch = prefer_huge_pages(torch.empty(hi - lo, dtype=dt))
                    got = read_into(self._fd(rank), off, scratch, what, checksum=self.verify, wait=False)
                    dst.copy_(scratch[x - lo : y - lo])
                pending.append((got, crc, what))
                if len(pending) > 2:  # at most two segments (and their scratch buffers) in flight
                    old_got, old_crc, old_what = pending.pop(0)
                    self._check(old_got.result() if old_got is not None else None, old_crc, old_what)
                i += 1
        finally:
            results = [(got.result() if got is not None else None, crc, what) for got, crc, what in pending]
        for got, crc, what in results:
            self._check(got, crc, what)
        return out

    def _check(self, got: int | None, crc: int, what: str) -> None:
        if self.verify and got != crc:
            raise CheckpointError(f"{self.dir}: checksum mismatch in {what}: the file is corrupted")


# -- matching the new run against the checkpoint (`_same_model.py`) -------------------------------
def source_key(reader: Reader, leaf: Leaf, like: TrainState) -> str:
    """Which stored tensor fills `leaf` (`stored_key`: master and params stand in for each other)."""
    whole = leaf.unit is None and leaf.key.partition("/")[0] == "params"  # no stand-in for replicated params
    key = leaf.key if whole else stored_key(reader.tensors, leaf.key, leaf.tensor.dtype)
    if key not in reader.tensors:
        raise CheckpointError(
            f"the checkpoint has no {leaf.key!r}, which the state you are loading into needs for {leaf.path!r}; was "
            f"it saved with another optimizer (the checkpoint's: {reader.index.get('optimizer')}, the state's: "
            f"{type(like.opt_state).__name__})?"
        )
    return key


def _restore_rng(ix: dict, rank: int) -> None:
    states = ix["rng"]
    if not states:
        return
    st = states[rank % len(states)]
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(st["cpu"]), dtype=torch.uint8))
        if st.get("cuda") and torch.cuda.is_available():
            n = min(len(st["cuda"]), torch.cuda.device_count())
            for i in range(n):
                torch.cuda.set_rng_state(torch.frombuffer(bytearray(st["cuda"][i]), dtype=torch.uint8), i)
    except (RuntimeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's RNG state is invalid: {e}") from None


def load(
    path: str | os.PathLike,
    like: TrainState,
    *,
    tag: str | None = None,
    verify: bool = True,
    restore_rng: bool = True,
    keep_frozen: bool = False,
) -> tuple[TrainState, Any]:
    """`fnzero.checkpoint.load` (`_resume.py`, which documents the arguments) for fnzero's own
    checkpoints."""
    if not isinstance(like, TrainState):
        raise CheckpointError(f"load needs like= a fnzero.TrainState, got {type(like).__name__}")
    tp = like.sharding.tp if like.sharding.tp is not None and like.sharding.tp.size > 1 else None
    from ..offload import is_nvme, like_in_memory, restore_into_store

    check_ep_supported(like)
    if is_nvme(like) and tp is not None:
        raise CheckpointError("loading into a tensor-parallel state with its optimizer on NVMe is not implemented yet")
    if is_nvme(like):
        # Load as the CPU-offload layout, then write master and moments into like's store.
        state, client = load(path, like_in_memory(like), tag=tag, verify=verify, restore_rng=restore_rng,
                             keep_frozen=keep_frozen)
        return restore_into_store(state, like), client
    with Reader(resolve(path, tag), verify=verify) as rd:
        ix = rd.index
        view, slots = _matched(ix, like, tp, keep_frozen)
        ep = like.sharding.ep

        def fill(leaf: Leaf) -> torch.Tensor:
            t = leaf.tensor
            out = prefer_huge_pages(torch.empty(t.numel(), dtype=t.dtype))  # every element is read or zeroed below
            if leaf.path.startswith("frozen/"):  # by parameter name, however it was stored (`_frozen.py`)
                fplan = view.sharding.plan if tp is not None else None
                return fill_frozen(leaf, like, rd, out, keep_frozen, tp, fplan).reshape(t.shape).to(t.device)
            if leaf.per_rank or _kept_transient(leaf, rd, like):
                return read_per_rank_leaf(leaf, ix, like, rd) if leaf.per_rank else t
            if slots is not None and leaf.unit is not None:
                fplan = view.sharding.plan if tp is not None else None
                return fill_by_name(leaf, like, rd, slots, out, tp, fplan, ep).reshape(t.shape).to(t.device)
            key = source_key(rd, leaf, like)
            entry = rd.tensors[key]
            if tp is not None:  # whole parameters on disk, this rank's slices in like
                return fill_tp_leaf(leaf, like, view.sharding.plan, rd.read, key, out).reshape(t.shape).to(t.device)
            if leaf.unit is None:
                if shape_of(entry.get("shape")) != tuple(t.shape):
                    raise mismatch(leaf.path, tuple(t.shape), shape_of(entry.get("shape")))
                rd.read(key, 0, t.numel(), out)
            else:
                numel = next(u["numel"] for u in ix["units"] if u["name"] == leaf.unit)
                lo, hi = leaf.lo, min(leaf.hi, numel)
                n_real = max(0, hi - lo)
                if n_real:
                    rd.read(key, lo, hi, out[:n_real])
                out[n_real:].zero_()  # padding
            return out.reshape(t.shape).to(t.device)

        state = rebuild_into_constants(like, fill, step=torch.tensor(ix["step"], dtype=torch.int64))
        ls = ix.get("loss_scale")
        if like.loss_scale is not None and ls is not None:
            L = like.loss_scale
            state = state.replace(loss_scale=LossScaleState(
                scale=torch.tensor(float(ls["scale"]), dtype=L.scale.dtype),
                good_steps=torch.tensor(ls["good_steps"], dtype=L.good_steps.dtype),
                hysteresis=torch.tensor(ls["hysteresis"], dtype=L.hysteresis.dtype),
            ))
        if restore_rng:
            pp = like.sharding.pp  # a pipeline's ranks restore by their rank in the job
            _restore_rng(ix, pp.world.rank if pp is not None and pp.world is not None else like.sharding.rank)
        return state, ix.get("client_state")


def _kept_transient(leaf: Leaf, rd, like: TrainState) -> bool:
    """A persistent=False buffer (a Llama's rotary inv_freq) the checkpoint lacks, as one converted
    from DeepSpeed's does: `like`'s value is kept."""
    return leaf.path not in rd.tensors and leaf.path[len("buffers/"):] in like.sharding.plan.saved.non_persistent


def _matched(ix: dict, like: TrainState, tp, keep_frozen: bool) -> tuple[TrainState, dict | None]:
    """(`like` as the files hold it: whole shapes, every layer's experts; the checkpoint's
    parameters by name where they are read by name, else None), once `check_model` found the
    checkpoint holds like's model."""
    view = tp_check_view(like) if tp is not None else like  # whole shapes where tp split them
    places = expert_places(view.sharding)  # every layer's experts, as the files hold them (`_ep.py`)
    view = ep_check_view(view, places) if places else view
    stage_only = like.sharding.pp is not None and like.sharding.pp.stages > 1  # some of the model's layers
    check_model(ix, view, subset=stage_only, keep_frozen=keep_frozen)
    # Other units than the checkpoint's (a pipeline stage, another wrap policy, a model cut into
    # layers), or this rank's experts of each layer: each parameter is found by its name (`_by_name.py`).
    by_name = stage_only or places is not None or not same_units(ix, unit_meta(view.sharding.plan))
    return view, saved_slots(ix) if by_name else None


def rebuild_into_constants(like: TrainState, fill, **changes) -> TrainState:
    """`rebuild_state(like, fill)`, except that frozen parameters and buffers are written into
    `like`'s own tensors, in place, once every leaf has been read (a load that fails leaves them as
    they were): they are the module's (`specs/checkpoint-format.md` §Frozen parameters). A shard
    whose values are in a store (`offload_param: nvme`, a placeholder in `like`) is written into the
    store and stays a placeholder: a new one for a training state's trainable shard, since the store
    now holds this state's, not `like`'s (`ShardSource.renew`)."""
    pending: list[tuple[torch.Tensor, torch.Tensor]] = []
    stored: list[tuple[ShardSource, str, torch.Tensor]] = []
    sources = sources_of(like.sharding)

    def leaf_value(leaf: Leaf) -> torch.Tensor:
        value = fill(leaf)
        field = leaf.path.partition("/")[0]
        if field in ("params", "frozen") and is_placeholder(leaf.tensor):
            if not is_placeholder(value):  # (a kept frozen shard, `keep_frozen`, is the store's already)
                source, unit = sources.of(field == "frozen"), leaf.path.partition("/")[2]
                stored.append((source, unit, value))
                if field == "params" and like.master is not None:  # (an inference engine's loads in place)
                    return source.renew(unit, leaf.tensor)  # the store holds this state's shard, not `like`'s
            return leaf.tensor
        if field not in ("frozen", "buffers"):
            return value
        pending.append((leaf.tensor, value))
        return leaf.tensor

    state = rebuild_state(like, leaf_value, **changes)
    with torch.no_grad():
        for own, value in pending:
            own.copy_(value)
    with contextlib.ExitStack() as updates:  # one update of each store: all its shards, or it refuses all later use
        for store in {id(source.store): source.store for source, _, _ in stored}.values():
            updates.enter_context(store.updating("checkpoint load", int(state.step)))
        for source, unit, value in stored:
            source.write(unit, value)
        if any(source.kind != "frozen" for source, _, _ in stored):  # the trainable shards are now those of its step
            sources.params.store.set_step(int(state.step))
    return state
