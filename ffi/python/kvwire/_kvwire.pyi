"""Type stubs of ``kvwire._kvwire``, the native half of the ``kvwire`` package (the Rust crate
``kvwire-py``, ``ffi/src``). Every public name of the module is declared here
(``tests/python/test_stubs.py`` checks it). The exceptions live in :mod:`kvwire.errors`.

Times are seconds (floats) unless a name says nanoseconds; ``now`` arguments of the connector
cores are nanoseconds of one monotonic clock (``time.monotonic_ns()``).
"""

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any, final

__version__: str
# In the order the module adds them (stubtest checks it against the runtime).
__all__ = [
    "Engine", "Region", "RemoteRegion", "Peer", "Batch", "BatchStats", "Notification",
    "TransferEngine", "LayerStream", "LayerStats", "StreamStats", "CudaStager", "CudaSource",
    "DCore", "PCore", "CONNECTOR_BUCKET_BOUNDS", "Send", "MayReserve", "MayLand",
    "ReleaseBlocks", "ReleaseLanding", "ReportFinished", "ReportFailed", "DisconnectPeer",
    "Transfer", "Destination", "CancelTransfers", "rdma_contexts_open", "__version__",
]

#: Upper bounds (seconds) of the connector's latency histogram buckets, ``inf`` last.
CONNECTOR_BUCKET_BOUNDS: list[float]

#: A remote region: a :class:`RemoteRegion`, a :class:`Region`, or ``(index, generation)``.
_RegionRef = RemoteRegion | Region | tuple[int, int]
#: Block ids: one list for every layer, or one list per layer.
_Blocks = Sequence[int] | Sequence[Sequence[int]]

# ---- the transfer engine (ffi/src/engine.rs) ----

@final
class Region:
    """A region registered with (or allocated by) a local engine."""

    @property
    def len(self) -> int: ...
    @property
    def addr(self) -> int | None:
        """Address of caller memory registered with ``Engine.register`` (None for ``alloc``)."""
    @property
    def access(self) -> str:
        """Access granted to peers: ``"rw"``, ``"wo"``, ``"ro"`` or ``"local"``."""
    @property
    def index(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def id(self) -> tuple[int, int]:
        """``(index, generation)``: the id peers use to name this region."""

@final
class RemoteRegion:
    """A region a peer offers."""

    @property
    def index(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def access(self) -> str: ...
    @property
    def id(self) -> tuple[int, int]: ...

@final
class Peer:
    """A connected peer."""

    @property
    def id(self) -> int: ...
    @property
    def transport(self) -> str:
        """``"tcp"``, ``"shm"``, ``"rdma"`` or ``"cuda_ipc"``."""
    @property
    def remote_addr(self) -> str: ...
    @property
    def alive(self) -> bool: ...
    def regions(self) -> list[RemoteRegion]: ...

@final
class BatchStats:
    """What a completed batch did."""

    @property
    def bytes(self) -> int: ...
    @property
    def ops(self) -> int: ...
    @property
    def writes(self) -> int: ...
    @property
    def slices(self) -> int: ...
    @property
    def transport(self) -> str: ...

@final
class Batch:
    """The completion handle of one batch."""

    def wait(self, timeout: float | None = None) -> BatchStats:
        """Blocks until the batch completes; raises ``kvwire.TimeoutError`` after ``timeout``."""
    def poll(self) -> BatchStats | None: ...
    @property
    def done(self) -> bool: ...

@final
class Notification:
    """A notification delivered to this engine."""

    @property
    def peer(self) -> int: ...
    @property
    def tag(self) -> bytes: ...

@final
class Engine:
    """A kvwire transfer engine."""

    def __new__(
        cls,
        listen: str = "127.0.0.1:0",
        secret: bytes | None = None,
        transport: str = "auto",
        lanes: int | None = None,
        slice_size: int | None = None,
        deadline: float | None = None,
        connect_timeout: float | None = None,
        rdma_near: str | None = None,
    ) -> Engine: ...
    @property
    def listen_addr(self) -> str: ...
    @property
    def port(self) -> int: ...
    def alloc(self, length: int, access: str = "rw") -> Region: ...
    def register(self, addr: int, length: int, access: str = "rw", pinned: bool = False) -> Region: ...
    def register_device(self, addr: int, length: int, access: str = "rw", device: int = 0) -> Region: ...
    def unregister(self, region: Region) -> None: ...
    def local_write(self, region: Region, offset: int, data: bytes) -> None: ...
    def local_read(self, region: Region, offset: int, length: int) -> bytes: ...
    def connect(self, addr: str) -> Peer: ...
    def peers(self) -> list[Peer]: ...
    def write(
        self,
        peer: Peer,
        ops: Iterable[tuple[Region, int, _RegionRef, int, int]],
        notify: bytes | None = None,
        deadline: float | None = None,
    ) -> Batch:
        """``ops``: ``(local_region, local_offset, remote_region, remote_offset, length)``."""
    def layer_stream(
        self,
        peer: Peer,
        src: Region | CudaSource,
        dst_region: _RegionRef,
        *,
        num_layers: int,
        num_blocks: int,
        block_bytes: int,
        src_blocks: _Blocks,
        order: str = "kv_major",
        dst_blocks: _Blocks | None = None,
        notify: bytes | None = None,
        deadline: float | None = None,
        stager: CudaStager | None = None,
    ) -> LayerStream: ...
    def read(
        self,
        peer: Peer,
        ops: Iterable[tuple[Region, int, _RegionRef, int, int]],
        deadline: float | None = None,
    ) -> Batch: ...
    def get_notification(self, timeout: float = 1.0) -> Notification: ...
    def try_get_notification(self) -> Notification | None: ...
    def descriptor(self) -> dict[str, Any]:
        """``{"addr": str, "regions": [RemoteRegion, ...]}``."""
    def metrics(self) -> dict[str, Any]: ...
    def fence(self, addr: str) -> None:
        """Closes every connection with the engine at ``addr`` and refuses its process from then
        on (``FencedError``); another process at ``addr`` (the peer restarted) is accepted.
        Returns once none of its copies into this engine is running."""
    def unfence(self, addr: str) -> bool: ...
    def shutdown(self) -> None: ...
    def __enter__(self) -> Engine: ...
    def __exit__(
        self,
        _a: type[BaseException] | None,
        _b: BaseException | None,
        _c: TracebackType | None,
    ) -> bool: ...

# ---- layer streams and CUDA sources (ffi/src/layer.rs, ffi/src/cuda.rs) ----

@final
class LayerStats:
    """What one layer sent."""

    @property
    def bytes(self) -> int: ...
    @property
    def writes(self) -> int: ...
    @property
    def batches(self) -> int: ...

@final
class StreamStats:
    """What a finished stream sent."""

    @property
    def bytes(self) -> int: ...
    @property
    def writes(self) -> int: ...
    @property
    def batches(self) -> int: ...
    @property
    def layers(self) -> list[LayerStats]: ...
    @property
    def separate_notify(self) -> bool: ...

@final
class LayerStream:
    """A request's KV cache sent layer by layer to one peer (``Engine.layer_stream``)."""

    @property
    def num_layers(self) -> int: ...
    def layer_ready(
        self, layer: int, cuda_event: object | None = None, cuda_stream: object | None = None
    ) -> None: ...
    def set_destination(self, dst_blocks: _Blocks) -> None: ...
    def wait(self, timeout: float | None = None) -> StreamStats: ...
    def wait_layer(self, layer: int, timeout: float | None = None) -> LayerStats: ...
    def poll(self) -> StreamStats | None: ...
    @property
    def done(self) -> bool: ...
    def abort(self, reason: str = "aborted") -> None: ...

@final
class CudaStager:
    """Pinned host staging buffers for sending CUDA device memory over the engine."""

    def __new__(
        cls, engine: Engine, device: int = 0, buffers: int = 4, buffer_mb: float = 16.0
    ) -> CudaStager: ...
    @property
    def engine(self) -> Engine: ...
    @property
    def device(self) -> int: ...
    @property
    def buffers(self) -> int: ...
    @property
    def buffer_bytes(self) -> int: ...
    def register(self, ptr: int, length: int, keepalive: object | None = None) -> CudaSource: ...

@final
class CudaSource:
    """CUDA device memory registered with a :class:`CudaStager`: a ``src`` for layer streams."""

    @property
    def ptr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def stager(self) -> CudaStager: ...

# ---- the Mooncake drop-in (ffi/src/mooncake; kvwire.mooncake) ----

@final
class TransferEngine:
    """Drop-in for ``mooncake.engine.TransferEngine``: ``0`` on success, negative on failure
    (the reason in :meth:`last_error`)."""

    def __new__(cls) -> TransferEngine: ...
    def initialize(
        self,
        local_hostname: str,
        metadata_server: str = "P2PHANDSHAKE",
        protocol: str = "tcp",
        device_name: str = "",
    ) -> int: ...
    def initialize_ext(
        self,
        local_hostname: str,
        metadata_server: str,
        protocol: str,
        device_name: str,
        metadata_type: str = "",
    ) -> int: ...
    def get_rpc_port(self) -> int: ...
    def get_local_hostname(self) -> str: ...
    @property
    def transport(self) -> str | None: ...
    def last_error(self) -> str: ...
    def register_memory(self, buffer_addr: int, capacity: int, location: str = "*") -> int: ...
    def unregister_memory(self, buffer_addr: int) -> int: ...
    def batch_register_memory(
        self, buffer_addresses: list[int], capacities: list[int], location: str = "*"
    ) -> int: ...
    def batch_unregister_memory(self, buffer_addresses: list[int]) -> int: ...
    def allocate_managed_buffer(self, length: int) -> int: ...
    def free_managed_buffer(self, buffer_addr: int, length: int) -> int: ...
    def write_bytes_to_buffer(self, dest_address: int, src: bytes, length: int) -> int: ...
    def read_bytes_from_buffer(self, source_address: int, length: int) -> bytes: ...
    def get_first_buffer_address(self, segment_name: str) -> int: ...
    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int: ...
    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: int,
        notify: object | None = None,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int: ...
    def transfer_check_status(self, batch_id: int) -> int:
        """1 completed, 0 running, -1 failed, -2 timed out."""
    def get_batch_transfer_status(self, batch_ids: list[int]) -> int: ...
    def shutdown(self) -> None: ...

# ---- the P/D connector cores (ffi/src/core.rs; kvwire.core) ----

@final
class DCore:
    """Decode-side core: when to reserve, block ids to P, layers landing, reports."""

    def __new__(
        cls,
        policy: str,
        layers: int,
        transport: str = "tcp",
        incarnation: int = 1,
        *,
        heartbeat_interval: float | None = None,
        peer_timeout: float | None = None,
        wait_for_p_timeout: float | None = None,
        request_timeout: float | None = None,
        drain_timeout: float | None = None,
        orphan_timeout: float | None = None,
        tombstone_ttl: float | None = None,
    ) -> DCore: ...
    def arrived(self, req: int, peer: int, tokens: int, blocks: int, now: int) -> None: ...
    def reserved(self, req: int, blocks: list[int], now: int) -> None: ...
    def prefix_hit(self, req: int, blocks: int, now: int) -> None: ...
    def landing(self, req: int, slots: list[int], now: int) -> None: ...
    def land_fallback(self, req: int, now: int) -> None: ...
    def layer_landed(self, req: int, layer: int, bytes: int, now: int) -> None: ...
    def reported(self, req: int, now: int) -> None: ...
    def promoted(self, req: int, now: int) -> None: ...
    def first_token(self, req: int, now: int) -> None: ...
    def abort(self, req: int, now: int) -> None: ...
    def message(self, peer: int, data: bytes, now: int) -> None: ...
    def peer_up(self, peer: int, now: int) -> None: ...
    def peer_down(self, peer: int, now: int) -> None: ...
    def handle_timeout(self, now: int) -> None: ...
    def poll_timeout(self) -> int | None: ...
    def may_reserve(self, req: int) -> bool: ...
    def reserved_blocks(self, req: int) -> list[int]: ...
    def landed_layers(self, req: int) -> list[int]: ...
    @property
    def live_requests(self) -> int: ...
    def poll_actions(
        self,
    ) -> list[
        Send | MayReserve | MayLand | ReleaseBlocks | ReleaseLanding | ReportFinished
        | ReportFailed | DisconnectPeer
    ]: ...
    def poll_timeline(self) -> list[str]:
        """Finished timeline records as JSON lines."""
    def metrics(self, now: int) -> dict[str, Any]: ...

@final
class PCore:
    """Prefill-side core: layers sent as they are ready or after prefill, P's blocks released."""

    def __new__(
        cls,
        send_mode: str,
        layers: int,
        transport: str = "tcp",
        incarnation: int = 1,
        *,
        heartbeat_interval: float | None = None,
        peer_timeout: float | None = None,
        request_timeout: float | None = None,
        block_ids_timeout: float | None = None,
        transfer_timeout: float | None = None,
        drain_timeout: float | None = None,
        orphan_timeout: float | None = None,
        tombstone_ttl: float | None = None,
        announce_destination: bool = False,
    ) -> PCore: ...
    def queued(self, req: int, peer: int, now: int) -> None: ...
    def scheduled(self, req: int, peer: int, tokens: int, blocks: list[int], now: int) -> None: ...
    def layer_ready(self, req: int, layer: int, now: int) -> None: ...
    def prefill_done(self, req: int, now: int) -> None: ...
    def transfer_done(self, req: int, layer: int, bytes: int, now: int) -> None: ...
    def transfer_failed(self, req: int, layer: int, now: int) -> None: ...
    def abort(self, req: int, now: int) -> None: ...
    def message(self, peer: int, data: bytes, now: int) -> None: ...
    def peer_up(self, peer: int, now: int) -> None: ...
    def peer_down(self, peer: int, now: int) -> None: ...
    def handle_timeout(self, now: int) -> None: ...
    def poll_timeout(self) -> int | None: ...
    def has_destination(self, req: int) -> bool: ...
    @property
    def live_requests(self) -> int: ...
    def poll_actions(
        self,
    ) -> list[
        Send | Transfer | Destination | CancelTransfers | ReleaseBlocks | ReportFinished
        | ReportFailed | DisconnectPeer
    ]: ...
    def poll_timeline(self) -> list[str]: ...
    def metrics(self) -> dict[str, Any]: ...

# ---- the cores' actions (ffi/src/core_actions.rs; kvwire.core): frozen, usable in `match` ----

@final
class Send:
    """Send these encoded message bytes to the peer."""

    __match_args__ = ("peer", "data")
    @property
    def peer(self) -> int: ...
    @property
    def data(self) -> bytes: ...

@final
class MayReserve:
    """D: the request may now reserve ``blocks`` KV blocks."""

    __match_args__ = ("req", "blocks")
    @property
    def req(self) -> int: ...
    @property
    def blocks(self) -> int: ...

@final
class MayLand:
    """D, policy ``land``: the request may take ``blocks`` landing-pool slots."""

    __match_args__ = ("req", "blocks")
    @property
    def req(self) -> int: ...
    @property
    def blocks(self) -> int: ...

@final
class ReleaseBlocks:
    """Free these blocks."""

    __match_args__ = ("req", "blocks")
    @property
    def req(self) -> int: ...
    @property
    def blocks(self) -> list[int]: ...

@final
class ReleaseLanding:
    """D: free these landing-pool slots."""

    __match_args__ = ("req", "slots")
    @property
    def req(self) -> int: ...
    @property
    def slots(self) -> list[int]: ...

@final
class ReportFinished:
    """D: every layer landed; P: every layer was sent."""

    __match_args__ = ("req",)
    @property
    def req(self) -> int: ...

@final
class ReportFailed:
    """The request failed; on D ``blocks`` did not load."""

    __match_args__ = ("req", "blocks", "reason")
    @property
    def req(self) -> int: ...
    @property
    def blocks(self) -> list[int]: ...
    @property
    def reason(self) -> str: ...

@final
class DisconnectPeer:
    """Tear the connection to this peer down so that none of its writes can land any more;
    ``cause`` says why the core gave it up (for the log); ``reported`` when the host had
    reported it down (the core's own verdict otherwise: silence, a drain timeout)."""

    __match_args__ = ("peer", "cause", "reported")
    @property
    def peer(self) -> int: ...
    @property
    def cause(self) -> str: ...
    @property
    def reported(self) -> bool: ...

@final
class Transfer:
    """P: write layer ``layer`` from P's blocks ``src`` into D's ``dst``, then report it."""

    __match_args__ = ("req", "peer", "layer", "src", "dst", "landing")
    @property
    def req(self) -> int: ...
    @property
    def peer(self) -> int: ...
    @property
    def layer(self) -> int: ...
    @property
    def src(self) -> list[int]: ...
    @property
    def dst(self) -> list[int]: ...
    @property
    def landing(self) -> bool: ...

@final
class Destination:
    """P (with ``announce_destination``): D's block ids are known."""

    __match_args__ = ("req", "peer", "first", "src", "dst", "landing")
    @property
    def req(self) -> int: ...
    @property
    def peer(self) -> int: ...
    @property
    def first(self) -> int: ...
    @property
    def src(self) -> list[int]: ...
    @property
    def dst(self) -> list[int]: ...
    @property
    def landing(self) -> bool: ...

@final
class CancelTransfers:
    """P: cancel the request's transfers still in flight."""

    __match_args__ = ("req",)
    @property
    def req(self) -> int: ...

def rdma_contexts_open() -> int:
    """RDMA device contexts open in this process now (each device is opened once per process,
    shared by every engine in it that uses it)."""
