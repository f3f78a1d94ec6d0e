"""The distributed part of `torchmem estimate` (issue 24): a torchrun-style program runs as one rank (the traced
rank) of an emulated world, in one process, without waiting for peers.

* `init_process_group` (any backend: "nccl", "gloo", none; any init method: env://, tcp://, file://, a store)
  becomes torch's `fake` process group (`torch.testing._internal.distributed.fake_pg`) of the requested world size
  with rank = the traced rank: every collective returns at once and allocates its real outputs (on the emulated
  device: all-gather outputs, reduce-scatter inputs, DTensor redistributions), nothing is sent.
* `new_group` / `new_subgroups` / DeviceMesh sub-groups inherit the fake backend whatever backend they name.
* DeviceMesh: its rank map is a CPU tensor the mesh reads values from (`tolist`, `nonzero`); mesh code runs
  outside the fake mode (real CPU tensors, no device memory).
* DDP: the reducer's communication hook asserts on the fake backend ("expected the hook result is either a Tensor
  or a TensorList found None"). DDP's bucket memory does not depend on the world size, so a DDP module is built
  over a real 1-rank fake group (`DistributedDataParallel(process_group=<1-rank group>)`): its reducer allocates
  the same buckets (`bucket_cap_mb`, `gradient_as_bucket_view`, `static_graph`) and its all-reduce runs on one
  rank (which the fake group answers at once). What a world of N adds to a DDP rank is NCCL's own memory, which
  `nccl_model` states separately.
* `torch.cuda.device_count()` answers the processes per node; the rank's own GPU is the emulated cuda:0
  (`cuda:<LOCAL_RANK>` is mapped to it by the fake mode).
* The environment is set as torchrun sets it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
  ROLE_RANK, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID.

`nccl_model` is the documented model of NCCL memory outside PyTorch's allocator (see docs/estimator.md,
"Distributed"): unverified until measured on a multi-GPU machine.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any

_FAKE = "fake"


@dataclass(frozen=True)
class World:
    """The emulated job: `nnodes` x `nproc_per_node` ranks, of which `rank` is traced."""

    world_size: int = 1
    rank: int = 0
    nproc_per_node: int = 1
    # Given by the user (CLI flags, `estimate(world_size=...)`) or found in the environment: then the program
    # gets torchrun's variables even for one rank. A plain program (no flags, no WORLD_SIZE) keeps its
    # environment: libraries read LOCAL_RANK as "launched by torchrun".
    explicit: bool = False

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a world of {self.world_size} (0..{self.world_size - 1})")
        if self.nproc_per_node < 1:
            raise ValueError(f"nproc_per_node must be at least 1, got {self.nproc_per_node}")

    @property
    def local_world_size(self) -> int:
        return min(self.nproc_per_node, self.world_size)

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def nnodes(self) -> int:
        return (self.world_size + self.local_world_size - 1) // self.local_world_size

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    def env(self) -> dict[str, str]:
        """The variables torchrun sets for this rank."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"),
            "TORCHELASTIC_RUN_ID": os.environ.get("TORCHELASTIC_RUN_ID", "torchmem-estimate"),
        }

    def as_dict(self) -> dict[str, int]:
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "nproc_per_node": self.local_world_size,
            "nnodes": self.nnodes,
        }


def world_from_env(world_size: int | None = None, rank: int | None = None, nproc_per_node: int | None = None) -> World:
    """The world of an estimate: arguments first, else WORLD_SIZE / RANK / LOCAL_WORLD_SIZE from the environment
    (a script estimated inside a torchrun job, or with them exported), else 1 rank."""

    def env_int(name: str) -> int | None:
        raw = os.environ.get(name, "").strip()
        if not raw:
            return None
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} in the environment is not an integer") from None

    explicit = world_size is not None or rank is not None or env_int("WORLD_SIZE") is not None
    ws = world_size if world_size is not None else (env_int("WORLD_SIZE") or 1)
    r = rank if rank is not None else (env_int("RANK") or 0)
    if rank is None and r >= ws:
        r = 0
    per_node = nproc_per_node if nproc_per_node is not None else (env_int("LOCAL_WORLD_SIZE") or min(ws, 8))
    return World(world_size=ws, rank=r, nproc_per_node=per_node, explicit=explicit)


# ----------------------------------------------------------------------------------------------- NCCL model
# NCCL's documented defaults (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html):
#   NCCL_BUFFSIZE: "the size of the buffer that NCCL uses when communicating data between pairs of GPUs",
#   default 4194304 (4 MiB); it is allocated per channel and per peer connection, for each protocol
#   (Simple = BUFFSIZE, LL128 ~ BUFFSIZE x 0.94 (set by NCCL_LL128_BUFFSIZE), LL ~ 256 KiB).
#   NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS bound the channels (up to 32 on NVLink systems; ring and tree
#   connections each take their own buffers).
_NCCL_BUFFSIZE_DEFAULT = 4 << 20
_NCCL_LL_BYTES = 256 << 10  # LL protocol buffer per channel and peer (NCCL_LL_BUFFSIZE's order)
_NCCL_CHANNELS_DEFAULT = 16  # between NCCL's NVLink defaults (H100/H200 use 16-32 channels for rings)


def _env_bytes(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return int(raw, 0)
    except ValueError:
        return default


def nccl_model(communicators: list[int], *, world_size: int) -> dict[str, Any]:
    """NCCL's device memory outside PyTorch's allocator for one rank, from the communicators it is a member of
    (their sizes): per communicator of n > 1 ranks, peers = 2 (ring: previous and next) + tree peers (up to 3), and
    channels x peers x (Simple + LL128 + LL) buffers. A model from NCCL's documented defaults and its environment
    (NCCL_BUFFSIZE, NCCL_MAX_NCHANNELS, NCCL_LL128_BUFFSIZE): unverified until measured, stated with its range."""
    buff = _env_bytes("NCCL_BUFFSIZE", _NCCL_BUFFSIZE_DEFAULT)
    ll128 = _env_bytes("NCCL_LL128_BUFFSIZE", buff * 15 // 16)
    channels = _env_bytes("NCCL_MAX_NCHANNELS", _NCCL_CHANNELS_DEFAULT)
    channels = max(1, min(channels, _env_bytes("NCCL_MAX_NCHANNELS", 32)))
    per_peer_channel = buff + ll128 + _NCCL_LL_BYTES
    parts = []
    total = 0
    for n in communicators:
        if n <= 1:
            continue
        peers = 2 + (min(3, n - 1) if n > 2 else 0)
        b = channels * peers * per_peer_channel
        parts.append({"ranks": n, "peers": peers, "channels": channels, "bytes": b})
        total += b
    return {
        "bytes": total,
        # The real figure depends on the topology (NVLink/IB channels, which protocols NCCL enables, lazy
        # connection setup, NCCL_NVLS_ENABLE's multicast buffers): stated as -50 % / +100 %.
        "low_bytes": total // 2,
        "high_bytes": total * 2,
        "communicators": parts,
        "buffsize_bytes": buff,
        "channels": channels,
        "world_size": world_size,
        "verified": False,
        "source": "NCCL user guide, environment variables (NCCL_BUFFSIZE default 4 MiB, NCCL_MAX_NCHANNELS)",
    }


# ----------------------------------------------------------------------------------------------- emulation
class Emulation:
    """Installs the emulated world into torch.distributed for one session; `uninstall` restores everything and
    destroys the process groups it made."""

    def __init__(self, world: World, tracer) -> None:
        self.world = world
        self.tracer = tracer
        self.note = tracer.note
        self._patches: list[tuple[Any, str, Any]] = []
        self.initialized = False
        self.group_sizes: list[int] = []  # every process group of > 1 ranks this rank is a member of
        # The groups this rank ran a collective on (group name -> size): NCCL makes a group's communicator, and
        # its buffers, at the group's first collective (lazy init), so these are the NCCL model's communicators.
        self.groups_used: dict[str, int] = {}
        self.ddp_modules = 0
        # What makes ranks differ (rank classes): uneven shards (the shard group's ranks, the size of the sharded
        # dim: FSDP2 parameters, DTensor Shard placements) and pipeline stages (the pipeline group's ranks).
        self.uneven: dict[tuple[tuple[int, ...], int], str] = {}
        self.stage_groups: dict[tuple[int, ...], int] = {}

    def _patch(self, obj, name: str, value) -> None:
        self._patches.append((obj, name, obj.__dict__.get(name) if isinstance(obj, type) else getattr(obj, name)))
        setattr(obj, name, value)

    def install(self) -> bool:
        try:
            import torch.distributed as dist
        except ImportError:
            return False
        if not dist.is_available():
            return False
        import torch.distributed.distributed_c10d as c10d
        from torch.testing._internal.distributed import fake_pg  # noqa: F401 - registers the "fake" backend

        if self.world.explicit or self.world.world_size > 1:
            os.environ.update(self.world.env())
        # init_process_group wraps sys.excepthook to prefix "[rankN]: "; put back at uninstall, or every estimate
        # of one process (`torchmem.estimate` in a loop) would add one more prefix to a later traceback.
        self._patch(sys, "excepthook", sys.excepthook)
        self._patch_init(dist, c10d)
        self._patch_groups(dist, c10d)
        self._patch_mesh()
        self._patch_dtensor()
        self._patch_funcol()
        self._patch_ddp()
        self._patch_cuda()
        self._patch_classes()
        self.tracer.on_collective = self._saw_collective
        return True

    def _saw_collective(self, func, args) -> None:
        """Notes the process group a c10d operator runs on: a `ProcessGroup` script object (`c10d.*` ops) or a
        group name (`_c10d_functional.*`: DTensor and functional collectives)."""
        import torch
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        for a in args:
            pg = None
            if isinstance(a, torch.ScriptObject):
                try:
                    pg = dist.ProcessGroup.unbox(a)
                except Exception:  # noqa: BLE001 - a ReduceOp, a Work: not a group
                    continue
            elif isinstance(a, str) and func.namespace == "_c10d_functional":
                try:
                    pg = c10d._resolve_process_group(a)
                except Exception:  # noqa: BLE001 - a reduce op's name ("sum"), not a group
                    continue
            if pg is not None and pg.size() > 1:
                self.groups_used.setdefault(pg.group_name, pg.size())

    # -- init_process_group
    def _patch_init(self, dist, c10d) -> None:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        original = c10d.init_process_group
        sig = inspect.signature(original)
        emu = self

        @functools.wraps(original)
        def init_process_group(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs).arguments
            backend = bound.get("backend")
            method = bound.get("init_method")
            asked_ws = bound.get("world_size", -1)
            asked_rank = bound.get("rank", -1)
            w = emu.world
            if asked_ws not in (None, -1) and int(asked_ws) != w.world_size:
                emu.note(
                    f"init_process_group(world_size={asked_ws}) was given; the estimate emulates the world of "
                    f"{w.world_size} (--nnodes x --nproc-per-node, or WORLD_SIZE)"
                )
            if asked_rank not in (None, -1) and int(asked_rank) != w.rank:
                emu.note(f"init_process_group(rank={asked_rank}) was given; the traced rank is {w.rank}")
            emu.note(
                f"init_process_group({'backend=' + repr(str(backend)) if backend else ''}"
                f"{', ' if backend and method else ''}{'init_method=' + repr(method) if method else ''}) ran as "
                f"rank {w.rank} of an emulated world of {w.world_size} (torch's fake process group: collectives "
                "allocate their outputs, nothing is sent)"
            )
            kept = {k: bound[k] for k in ("timeout", "group_name") if bound.get(k) is not None}
            original(backend=_FAKE, store=FakeStore(), rank=w.rank, world_size=w.world_size, **kept)
            emu.initialized = True
            if w.world_size > 1:
                emu.group_sizes.append(w.world_size)

        self._patch(c10d, "init_process_group", init_process_group)
        self._patch(dist, "init_process_group", init_process_group)
        import torch.distributed.device_mesh as mesh

        if hasattr(mesh, "init_process_group"):
            self._patch(mesh, "init_process_group", init_process_group)

    # -- sub-groups: the fake backend whatever they name
    def _patch_groups(self, dist, c10d) -> None:
        original = c10d._new_group_with_tag
        sig = inspect.signature(original)
        emu = self

        @functools.wraps(original)
        def new_group_with_tag(*args, **kwargs):
            bound = sig.bind_partial(*args, **kwargs)
            a = bound.arguments
            if a.get("backend") not in (None, _FAKE):
                a["backend"] = None  # inherits the default group's: fake
            a.pop("pg_options", None)
            a.pop("device_id", None)
            group = original(*bound.args, **bound.kwargs)
            ranks = a.get("ranks")
            n = len(ranks) if ranks else emu.world.world_size
            if group is not None and group is not c10d.GroupMember.NON_GROUP_MEMBER and n > 1:
                emu.group_sizes.append(n)
            return group

        self._patch(c10d, "_new_group_with_tag", new_group_with_tag)

    # -- DeviceMesh: CPU bookkeeping outside the fake mode
    def _patch_mesh(self) -> None:
        try:
            import torch.distributed.device_mesh as mesh
        except ImportError:
            return
        from torch.utils._python_dispatch import _disable_current_modes

        def outside_modes(f):
            @functools.wraps(f)
            def call(*args, **kwargs):
                with _disable_current_modes():
                    return f(*args, **kwargs)

            return call

        note = self.note

        def real_rank_map(t, *, said: bool = True):
            # A rank map made under the fake mode (`init_device_mesh`'s `torch.arange`, a program's
            # `torch.arange(8).view(2, 4)`) has no values: the identity map of its shape, which is what those are.
            from torch._subclasses.fake_tensor import FakeTensor

            if isinstance(t, FakeTensor):
                import torch

                if said:
                    note(
                        "a DeviceMesh was given a rank tensor made on the emulated device (no values): the "
                        "identity mapping of its shape (torch.arange) was used"
                    )
                return torch.arange(t.numel(), dtype=torch.int).view(tuple(t.shape))
            return t

        cls = getattr(mesh, "DeviceMesh", None)
        if cls is not None and isinstance(cls, type):
            for name, value in list(vars(cls).items()):
                if inspect.isfunction(value) and name not in ("__repr__", "__str__", "__hash__", "__eq__"):
                    self._patch(cls, name, outside_modes(value))
            mesh_init = vars(cls)["__init__"]

            @functools.wraps(mesh_init)
            def init(mesh_self, *args, **kwargs):
                with _disable_current_modes():
                    args = tuple(real_rank_map(a) for a in args)
                    if "mesh" in kwargs:
                        kwargs["mesh"] = real_rank_map(kwargs["mesh"])
                    if "_rank_map" in kwargs:  # init_device_mesh's own torch.arange: the identity, exactly
                        kwargs["_rank_map"] = real_rank_map(kwargs["_rank_map"], said=False)
                return mesh_init(mesh_self, *args, **kwargs)

            self._patch(cls, "__init__", init)
        if hasattr(mesh, "init_device_mesh"):
            wrapped = outside_modes(mesh.init_device_mesh)
            self._patch(mesh, "init_device_mesh", wrapped)
            import torch.distributed as dist

            if hasattr(dist, "init_device_mesh"):
                self._patch(dist, "init_device_mesh", wrapped)

    # -- DTensor: its sharding propagation is not an allocation
    def _patch_dtensor(self) -> None:
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:
            return
        name = "_propagate_tensor_meta_non_cached"
        original = vars(ShardingPropagator).get(name)
        if original is None:
            return
        tracer = self.tracer

        @functools.wraps(original)
        def propagate(*args, **kwargs):
            # Runs the op on fake tensors of the GLOBAL shape to learn the output's shape: on the emulated device
            # those looked like allocations of the unsharded tensor.
            with tracer.pause():
                return original(*args, **kwargs)

        self._patch(ShardingPropagator, name, propagate)

    def _patch_funcol(self) -> None:
        """`wait_tensor` returns its input on a GPU (c10d's kernel only unregisters the work), so a functional
        collective's output (DTensor's all-reduce of a Partial, TP's all-gathers) is one block. Its meta kernel,
        which runs on the emulated device, returns a new tensor (`empty_like`): every wait looked like a second
        block of the output's size, alive with the collective's until the collective's was freed. On the emulated
        world nothing waits, so the module's `wait_tensor` / `wait_tensors` (what funcol and
        AsyncCollectiveTensor call) return their inputs."""
        try:
            import torch.distributed._functional_collectives as funcol
        except ImportError:
            return
        if hasattr(funcol, "wait_tensor"):
            self._patch(funcol, "wait_tensor", lambda tensor: tensor)
        if hasattr(funcol, "wait_tensors"):
            self._patch(funcol, "wait_tensors", lambda tensors: list(tensors))

    # -- DDP
    def _patch_ddp(self) -> None:
        try:
            import torch.nn.parallel.distributed as ddp_mod
        except ImportError:
            return
        DDP = ddp_mod.DistributedDataParallel
        sig = inspect.signature(DDP.__init__)
        emu = self

        def init(ddp, *args, **kwargs):
            import torch

            a = sig.bind_partial(ddp, *args, **kwargs).arguments
            torch.nn.Module.__init__(ddp)
            ddp.module = a["module"]
            ddp.device_ids = a.get("device_ids")
            ddp.output_device = a.get("output_device")
            ddp.process_group = a.get("process_group")
            ddp.gradient_as_bucket_view = bool(a.get("gradient_as_bucket_view", False))
            ddp.static_graph = bool(a.get("static_graph", False))
            ddp.find_unused_parameters = bool(a.get("find_unused_parameters", False))
            ddp.require_backward_grad_sync = True
            ddp.require_forward_param_sync = True
            ddp._emulated_buckets = _DdpBuckets(ddp, a, emu)
            emu.ddp_modules += 1
            emu.note(
                "DistributedDataParallel is emulated (its C++ reducer needs a real device and its comm hook "
                "asserts on the fake backend): its gradient buckets are allocated as the reducer does "
                "(bucket_cap_mb, gradient_as_bucket_view, one bucket per dtype at first, rebuilt in gradient "
                "order at the second forward); the reducer's buffer broadcast and timing events are not modelled"
            )

        def forward(ddp, *inputs, **kwargs):
            ddp._emulated_buckets.before_forward()
            return ddp.module(*inputs, **kwargs)

        @contextlib.contextmanager
        def no_sync(ddp):
            old = ddp.require_backward_grad_sync
            ddp.require_backward_grad_sync = False
            try:
                yield
            finally:
                ddp.require_backward_grad_sync = old

        def register_comm_hook(ddp, state, hook):
            emu.note("a DDP communication hook was registered: the emulation ignores it (no compression modelled)")

        def train(ddp, mode=True):
            import torch

            return torch.nn.Module.train(ddp, mode)

        self._patch(DDP, "__init__", init)
        self._patch(DDP, "forward", forward)
        self._patch(DDP, "no_sync", no_sync)
        self._patch(DDP, "register_comm_hook", register_comm_hook)
        self._patch(DDP, "train", train)

    # -- torch.cuda: one GPU per local rank
    def _patch_cuda(self) -> None:
        import torch

        w = self.world
        # Every rank has local_world_size GPUs to choose from, and its own is the emulated one, cuda:0 (the fake
        # mode maps `cuda:<local rank>` to it: `.cuda()`, "cuda" and `cuda:{LOCAL_RANK}` tensors never mismatch).
        self._patch(torch.cuda, "device_count", lambda: w.local_world_size)
        # torch's accelerator API answers from the C++ runtime (no CUDA device here: "cpu"); FSDP2's default
        # mesh, DTensor and torchtitan-style code ask it which device to put the job on.
        cuda = torch.device("cuda")
        self._patch(torch._C, "_get_accelerator", lambda *_a, **_k: cuda)
        acc = getattr(torch, "accelerator", None)
        if acc is not None:
            answers = {
                "is_available": lambda *_a, **_k: True,
                "current_accelerator": lambda *_a, **_k: cuda,
                "device_count": lambda *_a, **_k: w.local_world_size,
                "current_device_index": lambda *_a, **_k: 0,
                "current_device_idx": lambda *_a, **_k: 0,
                "set_device_index": lambda *_a, **_k: None,
                "set_device_idx": lambda *_a, **_k: None,
                "synchronize": lambda *_a, **_k: None,
            }
            for name, value in answers.items():
                if hasattr(acc, name):
                    self._patch(acc, name, value)

    # -- rank classes: what differs between ranks
    def _shard(self, group_ranks: list[int] | None, size: int, what: str) -> None:
        """A dim of `size` split over the group `group_ranks` (torch.chunk): ranks differ when it does not divide."""
        if not group_ranks or len(group_ranks) <= 1 or size % len(group_ranks) == 0:
            return
        self.uneven.setdefault((tuple(group_ranks), int(size)), what)

    def _patch_classes(self) -> None:
        emu = self

        def ranks_of(group) -> list[int] | None:
            import torch.distributed as dist
            from torch.utils._python_dispatch import _disable_current_modes

            try:
                with _disable_current_modes():
                    return [int(r) for r in dist.get_process_group_ranks(group)]
            except Exception:  # noqa: BLE001 - a group we cannot read: treated as symmetric
                return None

        try:  # FSDP2: each parameter's dim `fsdp_placement.dim`, chunked over the shard group
            from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        except ImportError:
            FSDPParam = None
        if FSDPParam is not None and "_init_sharded_param" in vars(FSDPParam):
            original = vars(FSDPParam)["_init_sharded_param"]

            @functools.wraps(original)
            def init_sharded_param(fp, *args, **kwargs):
                out = original(fp, *args, **kwargs)
                try:
                    mi = fp.mesh_info
                    group = getattr(mi, "shard_process_group", None)
                    if group is None and getattr(mi, "shard_mesh_dim", None) is not None:
                        group = mi.mesh.get_group(mi.shard_mesh_dim)
                    if group is not None:
                        emu._shard(ranks_of(group), fp._orig_size[fp.fsdp_placement.dim], "FSDP2 shard")
                except Exception:  # noqa: BLE001 - bookkeeping never fails the program
                    pass
                return out

            self._patch(FSDPParam, "_init_sharded_param", init_sharded_param)

        try:  # DTensor Shard placements (tensor parallel's colwise/rowwise parameters, distribute_tensor)
            from torch.distributed.tensor.placement_types import Shard
        except ImportError:
            Shard = None
        if Shard is not None and "_shard_tensor" in vars(Shard):
            original_shard = vars(Shard)["_shard_tensor"]

            @functools.wraps(original_shard)
            def shard_tensor(pl, tensor, mesh, mesh_dim, *args, **kwargs):
                try:
                    emu._shard(ranks_of(mesh.get_group(mesh_dim)), tensor.size(pl.dim), "DTensor shard")
                except Exception:  # noqa: BLE001
                    pass
                return original_shard(pl, tensor, mesh, mesh_dim, *args, **kwargs)

            self._patch(Shard, "_shard_tensor", shard_tensor)

        try:  # pipeline stages: each rank of the pipeline group runs its own stage
            from torch.distributed.pipelining.stage import _PipelineStageBase
        except ImportError:
            _PipelineStageBase = None
        if _PipelineStageBase is not None:
            original_stage = vars(_PipelineStageBase)["__init__"]
            sig = inspect.signature(original_stage)

            @functools.wraps(original_stage)
            def stage_init(st, *args, **kwargs):
                original_stage(st, *args, **kwargs)
                try:
                    import torch.distributed as dist

                    a = sig.bind_partial(st, *args, **kwargs).arguments
                    group = a.get("group") or dist.group.WORLD
                    ranks = ranks_of(group)
                    if ranks and len(ranks) > 1:
                        emu.stage_groups.setdefault(tuple(ranks), int(a.get("num_stages") or len(ranks)))
                except Exception:  # noqa: BLE001
                    pass

            self._patch(_PipelineStageBase, "__init__", stage_init)
        self._patch_p2p()

    def _patch_p2p(self) -> None:
        """Point-to-point ops (pipeline stages' activations and gradients) on the emulated world: torch's fake
        process group answers send/recv at once in recent torch; where it does not, `irecv` returns its buffer
        (the stage's own, allocated before the receive: what the real job holds) and `isend`/`wait` complete."""
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        class Done:
            def wait(self, *args, **kwargs):
                return True

            def is_completed(self):
                return True

            def is_success(self):
                return True

        def wrap(name, fallback):
            original = getattr(c10d, name, None)
            if original is None:
                return

            @functools.wraps(original)
            def call(*args, **kwargs):
                try:
                    return original(*args, **kwargs)
                except (RuntimeError, NotImplementedError):
                    return fallback(*args, **kwargs)

            for mod in (c10d, dist):
                if getattr(mod, name, None) is original:
                    self._patch(mod, name, call)

        wrap("isend", lambda *a, **k: Done())
        wrap("irecv", lambda *a, **k: Done())
        wrap("batch_isend_irecv", lambda ops, *a, **k: [Done() for _ in ops])

    def rank_classes(self) -> list[dict[str, Any]]:
        """The ranks that behave alike, each class with the rank that stands for it (the traced rank for its own
        class, else the class's first rank). A rank's signature is its local size of every uneven split (the
        torch.chunk share of its coordinate in the shard group) and its coordinate in every pipeline group;
        groups are rows of a row-major mesh over the ranks (init_device_mesh's), so a rank's coordinate in the
        group like the traced rank's is (rank // stride) % size. Ranks with one signature are one class."""
        w = self.world
        every = list(range(w.world_size))
        if not self.uneven and not self.stage_groups:
            return [{"ranks": every, "traced_rank": w.rank, "symmetric": True, "what": "all ranks alike"}]

        def coordinate(group: tuple[int, ...], r: int) -> int:
            n = len(group)
            step = group[1] - group[0]
            if step > 0 and all(group[i] == group[0] + i * step for i in range(n)):
                return (r // step) % n
            return group.index(r) if r in group else group.index(w.rank) if w.rank in group else 0

        def share(size: int, n: int, c: int) -> int:
            chunk = -(-size // n)
            return max(0, min(chunk, size - c * chunk))

        splits = list(self.uneven)
        stages = list(self.stage_groups)
        by_sig: dict[tuple, list[int]] = {}
        for r in every:
            sig = tuple(share(size, len(g), coordinate(g, r)) for g, size in splits)
            sig += tuple(-1 - coordinate(g, r) for g in stages)
            by_sig.setdefault(sig, []).append(r)
        full = tuple(share(size, len(g), 0) for g, size in splits)
        classes = []
        for sig, ranks in by_sig.items():
            parts = []
            if stages:
                parts.append(
                    "pipeline stage " + "/".join(str(-1 - v) for v in sig[len(splits) :])
                    + f" of {self.stage_groups[stages[0]]}"
                )  # fmt: skip
            if splits:
                smaller = sum(1 for a, b in zip(sig, full, strict=False) if a < b)
                empty = sum(1 for a in sig[: len(splits)] if a == 0)
                if smaller:
                    parts.append(
                        f"{smaller} of {len(splits)} uneven split(s) smaller" + (f", {empty} empty" if empty else "")
                    )
                else:
                    parts.append("full shards")
            classes.append(
                {
                    "ranks": ranks,
                    "traced_rank": w.rank if w.rank in ranks else ranks[0],
                    "symmetric": len(by_sig) == 1,
                    "what": "; ".join(parts),
                }
            )
        return classes

    def uninstall(self) -> None:
        if self.tracer.on_collective == self._saw_collective:
            self.tracer.on_collective = None
        if self.initialized:
            try:
                import torch.distributed as dist

                if dist.is_initialized():
                    dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - taking down an emulated group never fails the estimate
                pass
            self.initialized = False
        for obj, name, old in reversed(self._patches):
            if isinstance(obj, type) and old is None:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, old)
        self._patches.clear()

    def summary(self) -> dict[str, Any]:
        d: dict[str, Any] = self.world.as_dict()
        d["process_group"] = "fake" if self.group_sizes or self.initialized else None
        used = list(self.groups_used.values())
        if self.ddp_modules and not used and self.world.world_size > 1:
            used = [self.world.world_size]  # DDP's reducer (emulated: no c10d operator) all-reduces on the default
        d["communicators"] = used
        d["ddp_modules"] = self.ddp_modules
        d["nccl"] = nccl_model(used, world_size=self.world.world_size)
        d["rank_classes"] = self.rank_classes()
        return d


class _DdpBuckets:
    """DDP's reducer memory, as `torch/csrc/distributed/c10d/reducer.cpp` allocates it: each bucket is one flat
    gradient tensor (`bucket.gradients`, per dtype) made at construction; parameters' gradients are copied into
    their bucket views when ready (`gradient_as_bucket_view=True`: the gradient becomes the view, no separate
    `.grad`), the bucket is all-reduced in place. Without `bucket_cap_mb` and without `find_unused_parameters` or
    `static_graph`, torch 2.x starts with one bucket per dtype and rebuilds the buckets at the second forward in
    the order gradients became ready (first bucket 1 MiB, then `bucket_cap_mb`, default 25 MiB): the new buckets
    are allocated before the old ones are freed. With `static_graph=True` the rebuild comes one iteration later,
    at the third forward, and the construction-time buckets are never freed: measured on an H100 (torch 2.11,
    the allocator history of `gpu_distributed_truth.py --child ddp-static`): the 4 GiB bucket allocated in
    `_ddp_init_helper` stays live to the end, beside the 16 rebuilt ones, so the third step's peak is one
    gradient-sized buffer higher than plain DDP's."""

    def __init__(self, ddp, a: dict, emu: Emulation) -> None:
        import torch
        import torch.distributed as dist

        self.ddp = ddp
        self.emu = emu
        cap_mb = a.get("bucket_cap_mb")
        self.cap_bytes = int((cap_mb if cap_mb is not None else 25) * 1024 * 1024)
        self.first_cap_bytes = dist._DEFAULT_FIRST_BUCKET_BYTES if cap_mb is None else self.cap_bytes
        self.as_view = ddp.gradient_as_bucket_view
        ignored = set(getattr(ddp.module, "_ddp_params_and_buffers_to_ignore", ()) or ())
        self.params = [p for n, p in ddp.module.named_parameters() if p.requires_grad and n not in ignored]
        self.ready_order: list[torch.nn.Parameter] = []
        self._ready_ids: set[int] = set()
        self.rebuilt = False
        self.grad_forwards = 0  # forwards with autograd on (the rebuild's clock)
        self.kept: list = []  # static_graph: the construction-time buckets, never freed
        if ddp.static_graph or not ddp.find_unused_parameters:
            limits = [1 << 62]
        else:
            limits = [self.first_cap_bytes, self.cap_bytes]
        # Initial buckets: the parameters in reverse order (DDP's assumption of gradient order).
        self.buckets: list = []
        self.views: dict[int, Any] = {}
        self.pending: dict[int, int] = {}
        self._allocate(self._assign(list(reversed(self.params)), limits))
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    @staticmethod
    def _assign(params: list, limits: list[int]) -> list[list]:
        """`compute_bucket_assignment_by_size`: per dtype, fill a bucket until its bytes reach the current
        limit (the limits are used in turn, the last one repeats)."""
        open_: dict[Any, tuple[list, int, int]] = {}
        out: list[list] = []
        for p in params:
            key = (p.dtype, p.device)
            members, size, li = open_.get(key, ([], 0, 0))
            members.append(p)
            size += p.numel() * p.element_size()
            if size >= limits[min(li, len(limits) - 1)]:
                out.append(members)
                open_[key] = ([], 0, li + 1)
            else:
                open_[key] = (members, size, li)
        out.extend(m for m, _, _ in open_.values() if m)
        return out

    def _allocate(self, groups: list[list]) -> None:
        import torch

        buckets = []
        views: dict[int, Any] = {}
        owner: dict[int, int] = {}
        for i, group in enumerate(groups):
            numel = sum(p.numel() for p in group)
            flat = torch.empty(numel, dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                views[id(p)] = flat[offset : offset + p.numel()].view(p.shape)
                owner[id(p)] = i
                offset += p.numel()
            buckets.append((flat, len(group)))
        old = self.buckets
        self.buckets, self.views, self.owner = buckets, views, owner
        self.pending = {i: n for i, (_, n) in enumerate(buckets)}
        if self.as_view:
            for p in self.params:
                if p.grad is not None:
                    v = views[id(p)]
                    v.copy_(p.grad)
                    p.grad = v
        del old  # the old buckets are freed after the new ones exist (reducer's rebuild order)

    def before_forward(self) -> None:
        ddp = self.ddp
        if not __import__("torch").is_grad_enabled():
            return
        self.grad_forwards += 1
        if (
            not self.rebuilt
            and self.ready_order
            and (ddp.static_graph or not ddp.find_unused_parameters)
            and self.grad_forwards >= (3 if ddp.static_graph else 2)
        ):
            self.rebuilt = True
            if ddp.static_graph:
                self.kept = [flat for flat, _ in self.buckets]
            order = self.ready_order + [p for p in self.params if id(p) not in self._ready_ids]
            self._allocate(self._assign(order, [self.first_cap_bytes, self.cap_bytes]))

    def _grad_ready(self, p) -> None:
        if not self.ddp.require_backward_grad_sync:
            return  # no_sync: gradients accumulate in .grad (the bucket view, with gradient_as_bucket_view)
        if id(p) not in self._ready_ids and not self.rebuilt:
            self._ready_ids.add(id(p))
            self.ready_order.append(p)
        view = self.views.get(id(p))
        if view is None or p.grad is None:
            return
        if self.as_view:
            if p.grad is not view:
                view.copy_(p.grad)
                p.grad = view
        else:
            view.copy_(p.grad)
        i = self.owner[id(p)]
        self.pending[i] -= 1
        if self.pending[i] == 0:
            import torch.distributed as dist

            flat = self.buckets[i][0]
            # In place on the fake group: nothing allocated, nothing sent. Without gradient_as_bucket_view the
            # reducer then copies the bucket back into each .grad, in place too.
            dist.all_reduce(flat)
            self.pending[i] = self.buckets[i][1]
