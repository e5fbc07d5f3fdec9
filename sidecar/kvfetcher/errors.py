"""errors: why a fetch fell back, a store failed or a request was refused — one vocabulary.

Every :class:`Reason` value is a metrics label (``kvfetcher_errors_total{reason=...}``,
``kvfetcher_fallbacks_total{reason=...}``) and the ``reason`` field of an API reply. Every error
class with a ``reason`` attribute holds one of its members; being a ``str`` enum, a member equals
its plain string value.

The refusals of a stored object (:class:`ContainerError` and its subclasses) live here, at the
bottom, because both the container parser and a KV destination that a chunk does not fit raise
them.
"""

from __future__ import annotations

from enum import Enum


class Reason(str, Enum):
    # the stored object is bad (it is deleted so that the next store repairs it)
    CORRUPT = "corrupt"
    TRUNCATED = "truncated"
    FOREIGN = "foreign"
    FINGERPRINT = "fingerprint"
    UNAUTHENTICATED = "unauthenticated"
    OTHER_KEY = "other_key"  # tagged under a key this reader does not hold (key rotation): a miss, never deleted
    # the object is fine but not for this reader
    VERSION = "version"
    INVALID = "invalid"
    GEOMETRY = "geometry"  # a chunk that does not fit the buffer's shape or dtype: the request's fault, never deleted
    # the store
    STORE_ERROR = "store_error"
    MISSING = "missing"
    STORE_DOWN = "store_down"
    STORE_FULL = "store_full"
    STORE_READ_ONLY = "store_read_only"
    # the fetch
    DEADLINE = "deadline"
    DECODER = "decoder"
    INTERNAL = "internal"
    # decisions, not failures
    MISS = "miss"
    COST_MODEL = "cost_model"
    # a tensor-parallel group (fetch.group): a rank's sidecar did not answer; the ranks found no common plan
    SIDECAR_DOWN = "sidecar_down"
    TP_GROUP = "tp_group"
    # the sidecar itself
    STORE_QUEUE_FULL = "store_queue_full"
    BAD_OBJECT_DELETED = "bad_object_deleted"
    WARM_UP = "warm_up"
    READERS = "readers"  # the reader processes could not start (reads stay in the sidecar's process)
    BAD_REQUEST = "bad_request"
    NO_DEVICE = "no_device"  # a CUDA buffer handle this sidecar cannot open (a registration refused; the client stages in host memory)

    def __str__(self) -> str:
        return self.value


#: reasons that mean the stored object itself is bad (not the link, not a newer writer)
BAD_OBJECT = frozenset({Reason.CORRUPT, Reason.TRUNCATED, Reason.FOREIGN, Reason.FINGERPRINT, Reason.UNAUTHENTICATED})


class ContainerError(ValueError):
    """Base of every reason a stored object is refused."""

    reason = Reason.INVALID


class ForeignObjectError(ContainerError):
    """Not a kvfetcher chunk at all (wrong magic)."""

    reason = Reason.FOREIGN


class FutureVersionError(ContainerError):
    """Written by a newer kvfetcher: refuse rather than guess."""

    reason = Reason.VERSION


class TruncatedError(ContainerError):
    """Fewer bytes than the header and its index promise."""

    reason = Reason.TRUNCATED


class CorruptError(ContainerError):
    """A checksum does not match, or the header or a bitstream does not parse."""

    reason = Reason.CORRUPT


class UnauthenticatedError(ContainerError):
    """With an object key configured: a tag does not verify under the name the object was read
    from (forged without the key, altered, copied from another name, or written without the key)."""

    reason = Reason.UNAUTHENTICATED


class OtherKeyError(ContainerError):
    """Tagged under a key (by its key id) this reader does not hold: another sidecar's, during a key
    rotation. A miss for this reader, never deleted (it cannot tell a valid object from a forged one)."""

    reason = Reason.OTHER_KEY


class FingerprintMismatchError(ContainerError):
    """A valid chunk, but of another model / dtype / layout namespace than its key names."""

    reason = Reason.FINGERPRINT


class GeometryMismatchError(ContainerError):
    """A chunk whose shape or dtype does not fit the destination buffer: not the object's fault
    (its key names its geometry), so it is a miss for this reader and is never deleted."""

    reason = Reason.GEOMETRY


class RequestError(ValueError):
    """The request itself is wrong (unknown buffer, bad slots...): the client's fault, a 400."""

    reason = Reason.BAD_REQUEST


class NoDeviceError(RequestError):
    """A CUDA buffer handle this sidecar cannot open: it sees no CUDA device (a device-plugin GPU
    given to the model container only), or not the buffer's. A 400 whose ``error`` is
    ``no_device``: the client registers host memory instead and copies to and from its GPU itself."""

    reason = Reason.NO_DEVICE
