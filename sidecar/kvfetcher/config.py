"""config: every setting of kvfetcher, declared once; the sidecar's :class:`Config` built from them.

Each :class:`Setting` is one environment variable: its name, type, default, a one-line doc and,
where the operator sets it, where the value comes from. The sidecar, the client, the evaluation
code and the operator read their settings through these declarations (no other module reads a
``KVFETCHER_*`` variable), the operator names what it injects by them, and
``python -m kvfetcher.config`` renders them as ``docs/configuration.md``.

Invariants: an unset or empty variable takes its default; a malformed one raises ``ValueError``
naming the variable. Importing this module imports only the standard library (the operator's
image has no torch): defaults that need more are computed when first read.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from decimal import ROUND_CEILING, Decimal
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE + _FALSE:
        raise ValueError(text)
    return word in _TRUE


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


#: type -> (its name in the docs, what an error says was expected, the parser of a variable's text)
_TYPES: dict[type, tuple[str, str, Callable[[str], Any]]] = {
    int: ("integer", "an integer", int),
    float: ("number", "a number", float),
    bool: ("flag", "a flag (1/0, true/false, yes/no, on/off)", _flag),
    str: ("string", "a string", str),
    tuple: ("list", "a comma-separated list", _names),
}


@dataclass(frozen=True)
class Setting:
    """One environment variable. Unset or empty, it reads as ``fallback``'s value when there is a
    fallback, else ``default`` (called when callable: such a default's docstring documents it).
    ``inject`` says where the operator takes the value from when it sets the variable in a pod;
    ``parse`` replaces the type's parser."""

    name: str
    type: type
    default: Any
    doc: str
    inject: str = ""
    fallback: Setting | None = None
    parse: Callable[[str], Any] | None = None

    def read(self, env: Mapping[str, str] | None = None) -> Any:
        """The value in ``env`` (default: the process environment)."""
        env = os.environ if env is None else env
        text = env.get(self.name, "")
        if not text:
            if self.fallback is not None:
                return self.fallback.read(env)
            return self.default() if callable(self.default) else self.default
        _, expected, parse = _TYPES[self.type]
        try:
            return (self.parse or parse)(text)
        except ValueError:
            raise ValueError(f"{self.name}: expected {expected}, got {text!r}") from None

    def shown_default(self) -> str:
        """The default as the docs show it."""
        if self.fallback is not None:
            return f"`{self.fallback.name}`"
        if callable(self.default):
            return self.default.__doc__ or ""
        if self.default is None or self.default == "":
            return "unset"
        if isinstance(self.default, tuple):
            return f"`{','.join(self.default)}`"
        return f"`{str(self.default).lower() if isinstance(self.default, bool) else self.default}`"


def _cuda() -> bool:
    import torch  # only when a default needs it: the operator reads this module without torch

    return torch.cuda.is_available()


def _decode_procs() -> int:
    """8 with CUDA, else 0"""
    return 8 if _cuda() else 0


def _read_procs() -> int:
    """4 with CUDA, else 0"""
    return 4 if _cuda() else 0


def _store_queue_bytes() -> int:
    """half the container's memory limit (its cgroup's), else 4 GiB"""
    limit = memory_limit()
    return limit // 2 if limit else 4 << 30


#: where a container's memory limit is read: cgroup v2, then v1
CGROUP_MEMORY = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def memory_limit(paths: tuple[str, ...] = CGROUP_MEMORY) -> int | None:
    """This container's memory limit in bytes (the first of ``paths`` that exists), or None where it has none."""
    for path in paths:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        return int(text) if text.isdigit() and int(text) < 1 << 60 else None  # "max", or v1's huge "none"
    return None


def _device() -> str:
    """`cuda` with CUDA, else `cpu`"""
    return "cuda" if _cuda() else "cpu"


def _home_cache(*parts: str) -> Callable[[], str]:
    def default() -> str:
        return os.path.join(os.path.expanduser("~"), ".cache", "kvfetcher", *parts)

    default.__doc__ = f"`{'/'.join(('~/.cache/kvfetcher',) + parts)}`"
    return default


DEFAULT_PRESETS = ("q8",)
#: Every preset a pool may name. The operator checks a pool's presets against these names (it
#: cannot import the codecs); :mod:`kvfetcher.format.presets` defines them, and a test keeps both equal.
PRESET_NAMES = ("raw", "exact", "q8", "lean", "balanced", "compact",
                "q8-ans", "balanced-ans", "compact-ans", "q8-zstd", "balanced-zstd", "compact-zstd",
                "transform-ans", "transform-zstd")
#: Those that quantise keys before RoPE: stored only where ``KVFETCHER_ROPE_THETA`` is set.
PRE_ROPE_PRESETS = ("lean", "balanced", "compact", "balanced-ans", "compact-ans", "balanced-zstd", "compact-zstd",
                    "transform-ans", "transform-zstd")


def _presets(text: str) -> tuple[str, ...]:
    return DEFAULT_PRESETS if text.strip() == "auto" else _names(text)


# -- the sidecar ------------------------------------------------------------------------------
CHUNK_TOKENS = Setting("KVFETCHER_CHUNK_TOKENS", int, 256, "Tokens per stored chunk.",
                       inject="`spec.codec.chunkTokens`")
PRESET = Setting("KVFETCHER_PRESET", tuple, DEFAULT_PRESETS,
                 "Representations written for each new chunk (`auto`: the default).",
                 inject="`spec.codec.storePresets`, less the pre-RoPE ones where the pod gives no RoPE base",
                 parse=_presets)
ALLOWED_PRESETS = Setting("KVFETCHER_ALLOWED_PRESETS", tuple, None,
                          "Representations a fetch may choose among (unset: any known).",
                          inject="`spec.codec.allowedPresets`")
POOL = Setting("KVFETCHER_POOL", str, "", "The KVCachePool's name.", inject="the pool's name")
TENANT = Setting("KVFETCHER_TENANT", str, "", "Key salt: prompts under different salts share no chunk.",
                 inject="the pool's Secret, a Secret or a pod label (`spec.tenancy`)", fallback=POOL)
OBJECT_KEY = Setting("KVFETCHER_OBJECT_KEY", str, "",
                     "Secret (16+ characters) that authenticates stored objects, each bound to its name "
                     "(unset: CRC-32 only: the store and everyone who can write to it are trusted).",
                     inject="the pool's Secret")
ACCEPTED_OBJECT_KEYS = Setting("KVFETCHER_ACCEPTED_OBJECT_KEYS", tuple, (),
                               "Previous object keys (comma-separated) whose tags are still accepted on read, never "
                               "written: a key rotation (docs/security.md). An object tagged under a key neither this "
                               "nor `KVFETCHER_OBJECT_KEY` names is a miss, never deleted.",
                               inject="the pool's Secret (`acceptedObjectKeys`, optional)")
TRUST_STORE = Setting("KVFETCHER_TRUST_STORE", bool, False,
                      "Without `KVFETCHER_OBJECT_KEY`, let stored bytes reach nvCOMP's decoder, which does not "
                      "validate its input (crafted frames with right CRC-32s can fault the GPU context): only where "
                      "everyone who can write the store is trusted. Off: `zstd` objects decode on the CPU, `ans` ones "
                      "are not read. With a key, tags are verified first either way.")
MODEL = Setting("KVFETCHER_MODEL", str, "", "The model fingerprint this sidecar serves: a register or plan "
                "naming another is refused (unset: whatever the client names).",
                inject="the pool's `spec.model.name`, else the pod's annotation `kvfetcher.io/model`")
RECOMPUTE_TPS = Setting("KVFETCHER_RECOMPUTE_TPS", float, 5000.0,
                        "Model prefill rate (tokens/s) when a request gives neither a rate nor a prefill model.")
ROPE_THETA = Setting("KVFETCHER_ROPE_THETA", float, None, "The model's RoPE base: needed to store pre-RoPE presets "
                     "(`lean`; calibrated presets take the model's per-layer bases from its calibration).",
                     inject="the pod's annotation `kvfetcher.io/rope-theta`")
TTFT_BUDGET_S = Setting("KVFETCHER_TTFT_BUDGET_S", float, None,
                        "Prefer a fetch within this TTFT (s) to a faster recompute (unset: the fastest wins).",
                        inject="`spec.sidecar.ttftBudgetSeconds`")
DECODE_PROCS = Setting("KVFETCHER_DECODE_PROCS", int, _decode_procs,
                       "Decode worker processes (0: decode in the sidecar's threads).",
                       inject="`spec.sidecar.decodeProcesses`")
WARM_UP = Setting("KVFETCHER_WARM_UP", bool, True, "Decode workers meet CUDA, NVDEC and each registered "
                  "buffer at start, not on the first fetch.")
S3_ENDPOINT = Setting("KVFETCHER_S3_ENDPOINT", str, "", "S3 endpoint URL (unset: the local `KVFETCHER_STORE_DIR`).",
                      inject="the pool's Secret")
S3_BUCKET = Setting("KVFETCHER_S3_BUCKET", str, "kvfetcher", "S3 bucket.", inject="the pool's Secret")
S3_ACCESS_KEY = Setting("KVFETCHER_S3_ACCESS_KEY", str, "", "S3 access key.",
                        inject="the pool's Secret or `spec.storage.external.credentialsSecretRef`")
S3_SECRET_KEY = Setting("KVFETCHER_S3_SECRET_KEY", str, "", "S3 secret key.",
                        inject="the pool's Secret or `spec.storage.external.credentialsSecretRef`")
S3_REGION = Setting("KVFETCHER_S3_REGION", str, "us-east-1", "S3 region.", inject="`spec.storage.external.region`")
S3_CA_FILE = Setting("KVFETCHER_S3_CA_FILE", str, None, "CA bundle the S3 endpoint's certificate is checked against.",
                     inject="`spec.storage.external.tls.caSecretRef`, mounted")
S3_INSECURE = Setting("KVFETCHER_S3_INSECURE", bool, False, "Skip the S3 endpoint's TLS certificate check.",
                      inject="`spec.storage.external.tls.insecureSkipVerify`")
STORE_DIR = Setting("KVFETCHER_STORE_DIR", str, _home_cache("store"), "Local store directory, without S3.")
AUTH_TOKEN = Setting("KVFETCHER_AUTH_TOKEN", str, "", "Bearer token of `/v1` over TCP (the Unix socket needs none).",
                     inject="the pool's Secret")
AUTH_TOKEN_FILE = Setting("KVFETCHER_AUTH_TOKEN_FILE", str, None, "File holding the token, when "
                          "`KVFETCHER_AUTH_TOKEN` is unset.")
DEADLINE_S = Setting("KVFETCHER_DEADLINE_S", float, 30.0,
                     "Seconds a lookup or fetch may take when the request gives none; also the store's read timeout.")
MAX_REQUEST_TOKENS = Setting("KVFETCHER_MAX_REQUEST_TOKENS", int, 262144,
                             "Most tokens one lookup, fetch or store request may name (more: a 400).")
STORE_QUEUE_CHUNKS = Setting("KVFETCHER_STORE_QUEUE_CHUNKS", int, 256,
                             "Bound of the store queue in chunks: a store queues the leading chunks that fit, "
                             "the rest are dropped and counted.")
STORE_QUEUE_BYTES = Setting("KVFETCHER_STORE_QUEUE_BYTES", int, _store_queue_bytes,
                            "Bound of the store queue in bytes of KV, beside its bound in chunks: a 70B model's "
                            "chunks are 2.5 times an 8B model's, and a full queue must fit the sidecar's memory.")
STORE_ENCODERS = Setting("KVFETCHER_STORE_ENCODERS", int, 2,
                         "Chunks the store encodes at once, each in a thread of low priority (an entropy-coded preset's on "
                         "the GPU); uploads overlap them. `benchmarks/store_rate` times the store path against it.")
STORE_ENCODE_BATCH = Setting("KVFETCHER_STORE_ENCODE_BATCH", int, 2,
                             "Consecutive chunks of a prefix one store encode codes together: on the GPU one nvCOMP "
                             "batch and one wait for them all, which spreads the encode's host work under the GIL.")
INDEX_KEYS = Setting("KVFETCHER_INDEX_KEYS", int, 1 << 18,
                     "Chunk keys the sidecar's in-memory index of the store keeps (least recently used dropped first; "
                     "about 400 bytes each).")
NEGATIVE_TTL_S = Setting("KVFETCHER_NEGATIVE_TTL_S", float, 5.0,
                         "Seconds a chunk found absent stays absent for lookups: a prefix another sidecar stores becomes "
                         "visible here within this plus one listing.")
IO_WORKERS = Setting("KVFETCHER_IO_WORKERS", int, 32, "Threads for store data I/O (GET, PUT).")
FETCH_WINDOW = Setting("KVFETCHER_FETCH_WINDOW", int, 4, "Chunks one fetch keeps in flight (read, verified, decoded "
                       "or written at once): more overlaps more of a chunk's latency, each holds a staging buffer.")
FETCH_READS = Setting("KVFETCHER_FETCH_READS", int, 8, "Ranged GETs one fetch keeps in flight (at most the data I/O threads).")
READ_PROCS = Setting("KVFETCHER_READ_PROCS", int, _read_procs, "Processes that read staged chunk parts (raw and entropy-coded) "
                     "from the store into shared memory, each with its own GIL (0: the data I/O threads read); "
                     "`benchmarks/paged_restore` times it against threads (a tuning's fourth number).")
DECODE_THREADS = Setting("KVFETCHER_DECODE_THREADS", int, 2, "Threads that decode entropy-coded chunks on the GPU "
                         "and unpack them into KV buffers, each on its own CUDA stream.")
WRITE_THREADS = Setting("KVFETCHER_WRITE_THREADS", int, 4, "Threads that write verified raw chunks into KV buffers "
                        "(their copies to the GPU and scatters), each on its own CUDA stream.")
META_IO_WORKERS = Setting("KVFETCHER_META_IO_WORKERS", int, 8,
                          "Threads for store metadata I/O (LIST, HEAD, DELETE, readiness), apart from data I/O.")
ACCESS_LOG_S = Setting("KVFETCHER_ACCESS_LOG_S", float, 15.0,
                       "Seconds between the access logs a sidecar writes (which chunks it fetched, for the "
                       "evictor's least-recently-used order; 0: none).")
STORE_CHECK_S = Setting("KVFETCHER_STORE_CHECK_S", float, 15.0,
                        "Seconds between the sidecar's checks of the store, exported as `kvfetcher_store_up` "
                        "(0: only when `/readyz` is asked); the store's health never decides the pod's readiness.")
FUSED_UNPACK = Setting("KVFETCHER_FUSED_UNPACK", bool, True, "Unpack CUDA frames with the fused Triton kernel.")
ENCODE_GRAPHS = Setting("KVFETCHER_ENCODE_GRAPHS", int, 2,
                        "CUDA graphs of the pack kept for the store's GPU encodes, lent to one encode thread at a time "
                        "(0: none, every pack launched op by op). A chunk kind's graph is captured at its second chunk; "
                        "each holds GPU memory for its intermediates (about 13 times a chunk's KV).")
LINK_DIR = Setting("KVFETCHER_LINK_DIR", str, None,
                   "Directory shared by the sidecars of a node (one per tensor-parallel rank, other pods'): each "
                   "announces its fetches there, and the cost model splits the node's link among them (unset: "
                   "each sidecar takes the link as its own).")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _choice(*allowed: str, upper: bool = False) -> Callable[[str], str]:
    def parse(text: str) -> str:
        word = text.strip().upper() if upper else text.strip().lower()
        if word not in allowed:
            raise ValueError(text)
        return word

    return parse


LOG_LEVEL = Setting("KVFETCHER_LOG_LEVEL", str, "INFO", f"Log level ({', '.join(LOG_LEVELS)}; `kvfetcher --log-level` and "
                    "the operator's `--verbose` win).", parse=_choice(*LOG_LEVELS, upper=True))
LOG_FORMAT = Setting("KVFETCHER_LOG_FORMAT", str, "text", "Log format: `text`, or `json` (one object a line; "
                     "`kvfetcher --log-json` wins).", parse=_choice("text", "json"))

# -- the model side (client) ------------------------------------------------------------------
SOCKET = Setting("KVFETCHER_SOCKET", str, None, "The sidecar's Unix socket (wins over `KVFETCHER_URL`).",
                 inject="the injected sidecar's socket path, in the model's container")
URL = Setting("KVFETCHER_URL", str, "http://127.0.0.1:8500",
              "The sidecar's HTTP address (with the sidecar's `KVFETCHER_AUTH_TOKEN`).")

# -- evaluation -------------------------------------------------------------------------------
CACHE = Setting("KVFETCHER_CACHE", str, _home_cache(), "Where the evaluation model's plain copy is kept.")
EVAL_DEVICE = Setting("KVFETCHER_EVAL_DEVICE", str, "cpu",
                      "Where `kvfetcher eval` and `calibrate` run the model (`cpu`, `cuda`, `cuda:N`).")
CALIBRATION_DIR = Setting("KVFETCHER_CALIBRATION_DIR", str, _home_cache("calibration"),
                          "Local model calibrations (`kvfetcher calibrate` writes here; a sidecar keeps those it fetched from the store here).")

# -- the operator -----------------------------------------------------------------------------
WEBHOOK_ADDR = Setting("KVFETCHER_WEBHOOK_ADDR", str, "0.0.0.0", "Admission webhook listen address.")
WEBHOOK_PORT = Setting("KVFETCHER_WEBHOOK_PORT", int, 9443, "Admission webhook port (HTTPS).")
WEBHOOK_CERT = Setting("KVFETCHER_WEBHOOK_CERT", str, "/etc/kvfetcher/webhook/tls.crt", "Webhook TLS certificate.")
WEBHOOK_KEY = Setting("KVFETCHER_WEBHOOK_KEY", str, "/etc/kvfetcher/webhook/tls.key", "Webhook TLS key.")
WEBHOOK_CONFIGURATION = Setting("KVFETCHER_WEBHOOK_CONFIGURATION", str, None,
                                "The MutatingWebhookConfiguration routing pods here (unset: not checked).")
METRICS_ADDR = Setting("KVFETCHER_METRICS_ADDR", str, "0.0.0.0", "`/metrics` listen address.")
METRICS_PORT = Setting("KVFETCHER_METRICS_PORT", int, 8080, "`/metrics` port.")
RETRY_SECONDS = Setting("KVFETCHER_RETRY_SECONDS", float, 10.0, "Delay before a failed reconcile is retried.")
RESYNC_SECONDS = Setting("KVFETCHER_RESYNC_SECONDS", float, 60.0, "Interval of the periodic pool resync.")
ENDPOINT_DENY = Setting("KVFETCHER_ENDPOINT_DENY", str, "",
                        "CIDRs an external endpoint may not reach, on top of the built-in list (comma-separated).")
ENDPOINT_ALLOW = Setting("KVFETCHER_ENDPOINT_ALLOW", str, "",
                         "CIDRs an external endpoint may reach despite the deny list (comma-separated).")
ENDPOINT_HOSTS = Setting("KVFETCHER_ENDPOINT_HOSTS", str, "",
                         "The only hosts an external endpoint may name, when set (comma-separated).")
SIDECAR_IMAGE = Setting("KVFETCHER_SIDECAR_IMAGE", str, "ghcr.io/kvfetcher/kvfetcher-sidecar:0.1.0",
                        "The sidecar image (and its evictor's and calibration Job's) of a pool whose "
                        "`spec.sidecar.image` is unset (the chart: `sidecar.image`, `global.imageRegistry`).")
MINIO_IMAGE = Setting("KVFETCHER_MINIO_IMAGE", str, "quay.io/minio/minio:RELEASE.2025-04-22T22-12-26Z",
                      "The MinIO image of a managed pool whose `spec.storage.managed.image` is unset "
                      "(the chart: `minio.image`, `global.imageRegistry`).")
NAMESPACE = Setting("KVFETCHER_NAMESPACE", str, None, "The operator's own namespace: MinIO's NetworkPolicy lets it in.")

#: component -> the settings it reads; the operator sets those marked ``inject`` of the sidecar's
#: table in the sidecar's container, and those of the model side's table in the model's
TABLES: dict[str, tuple[Setting, ...]] = {
    "Sidecar (`kvfetcher serve`)": (
        CHUNK_TOKENS, PRESET, ALLOWED_PRESETS, TENANT, POOL, OBJECT_KEY, ACCEPTED_OBJECT_KEYS, TRUST_STORE, MODEL, RECOMPUTE_TPS, ROPE_THETA, TTFT_BUDGET_S,
        DECODE_PROCS, WARM_UP, S3_ENDPOINT, S3_BUCKET, S3_ACCESS_KEY, S3_SECRET_KEY, S3_REGION, S3_CA_FILE,
        S3_INSECURE, STORE_DIR, AUTH_TOKEN, AUTH_TOKEN_FILE, FUSED_UNPACK, ENCODE_GRAPHS, DEADLINE_S, MAX_REQUEST_TOKENS,
        STORE_QUEUE_CHUNKS, STORE_QUEUE_BYTES, STORE_ENCODERS, STORE_ENCODE_BATCH, INDEX_KEYS, NEGATIVE_TTL_S, IO_WORKERS, FETCH_WINDOW, FETCH_READS, READ_PROCS, DECODE_THREADS, WRITE_THREADS, META_IO_WORKERS, LINK_DIR, ACCESS_LOG_S, STORE_CHECK_S,
        CALIBRATION_DIR, LOG_LEVEL, LOG_FORMAT),
    "Model side (`KVClient`, shared buffers)": (SOCKET, URL),
    "Evaluation (`kvfetcher eval`, `calibrate`, `demo`, tests)": (CACHE, EVAL_DEVICE),
    "Operator": (WEBHOOK_ADDR, WEBHOOK_PORT, WEBHOOK_CERT, WEBHOOK_KEY, WEBHOOK_CONFIGURATION,
                 METRICS_ADDR, METRICS_PORT, RETRY_SECONDS, RESYNC_SECONDS, ENDPOINT_DENY, ENDPOINT_ALLOW,
                 ENDPOINT_HOSTS, NAMESPACE, SIDECAR_IMAGE, MINIO_IMAGE, LOG_LEVEL, LOG_FORMAT),
}
SIDECAR, CLIENT, EVAL, OPERATOR = TABLES.values()


def env_field(setting: Setting, repr: bool = True) -> Any:
    """A dataclass field that :func:`read_fields` reads from ``setting``; its default is the
    setting's value in an empty environment. ``repr`` False keeps a secret out of the repr."""
    return field(default_factory=lambda: setting.read({}), metadata={"setting": setting}, repr=repr)


def read_fields(cls: type[T], env: Mapping[str, str] | None = None) -> T:
    """An instance of the dataclass ``cls`` whose :func:`env_field` fields are read from ``env``
    (default: the process environment); its other fields keep their defaults."""
    return cls(**{f.name: f.metadata["setting"].read(env) for f in fields(cls) if "setting" in f.metadata})


@dataclass
class Config:
    """The sidecar's settings. Fields with a :class:`Setting` come from the environment in
    :meth:`from_env`; the others are tuning constants. :meth:`validate` holds the invariants."""

    chunk_tokens: int = env_field(CHUNK_TOKENS)
    presets: tuple[str, ...] = env_field(PRESET)  # representations written for each chunk
    allowed_presets: tuple[str, ...] | None = env_field(ALLOWED_PRESETS)  # None: any known
    tenant: str = env_field(TENANT)
    object_key: str = env_field(OBJECT_KEY, repr=False)  # "": objects unauthenticated
    accepted_object_keys: tuple[str, ...] = env_field(ACCEPTED_OBJECT_KEYS, repr=False)  # read, never written
    trust_store: bool = env_field(TRUST_STORE)  # without a key: stored bytes may reach nvCOMP
    model: str = env_field(MODEL)  # "": any model fingerprint a client names
    recompute_tps: float = env_field(RECOMPUTE_TPS)
    rope_theta: float | None = env_field(ROPE_THETA)
    deadline_s: float = env_field(DEADLINE_S)  # default deadline of a lookup or fetch
    max_request_tokens: int = env_field(MAX_REQUEST_TOKENS)
    ttft_budget_s: float | None = env_field(TTFT_BUDGET_S)  # None: the fastest option wins
    store_queue_chunks: int = env_field(STORE_QUEUE_CHUNKS)
    store_queue_bytes: int = env_field(STORE_QUEUE_BYTES)
    store_encoders: int = env_field(STORE_ENCODERS)
    store_encode_batch: int = env_field(STORE_ENCODE_BATCH)
    index_keys: int = env_field(INDEX_KEYS)
    negative_ttl_s: float = env_field(NEGATIVE_TTL_S)
    decode_threads: int = env_field(DECODE_THREADS)
    write_threads: int = env_field(WRITE_THREADS)
    decode_procs: int = env_field(DECODE_PROCS)
    device: str = field(default_factory=_device)  # where the KV buffers live: decode workers warm up there
    warm_up: bool = env_field(WARM_UP)
    io_workers: int = env_field(IO_WORKERS)  # data I/O threads
    meta_io_workers: int = env_field(META_IO_WORKERS)  # metadata I/O threads
    link_dir: str | None = env_field(LINK_DIR)  # None: the node's link is not known to be shared
    window: int = env_field(FETCH_WINDOW)
    reads: int = env_field(FETCH_READS)
    read_procs: int = env_field(READ_PROCS)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Config:
        """The settings in ``env`` (default: the process environment), validated without presets."""
        c = read_fields(cls, env)
        c.validate()
        return c

    def validate(self, known_presets: Mapping[str, Any] | None = None) -> None:
        """Raise ``ValueError`` unless the settings can be served. With ``known_presets`` (name ->
        preset with a ``pre_rope`` flag) the preset names are checked too, and that a pre-RoPE
        preset has the model's RoPE base."""
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk tokens must be positive, not {self.chunk_tokens}")
        if not 0 < self.deadline_s < float("inf"):
            raise ValueError(f"the deadline must be positive, finite seconds, not {self.deadline_s}")
        for name in ("max_request_tokens", "store_queue_chunks", "store_queue_bytes", "index_keys", "io_workers", "meta_io_workers", "window", "reads",
                     "decode_threads", "write_threads", "store_encoders",
                     "store_encode_batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', ' ')} must be >= 1, not {getattr(self, name)}")
        if not 0 <= self.negative_ttl_s < float("inf"):
            raise ValueError(f"the negative TTL must be finite seconds >= 0, not {self.negative_ttl_s}")
        if self.object_key and len(self.object_key) < 16 or any(len(k) < 16 for k in self.accepted_object_keys):
            raise ValueError(f"{OBJECT_KEY.name} and {ACCEPTED_OBJECT_KEYS.name} must be at least 16 characters each")
        if self.accepted_object_keys and not self.object_key:
            raise ValueError(f"{ACCEPTED_OBJECT_KEYS.name} needs {OBJECT_KEY.name} (the key objects are written with)")
        if self.read_procs < 0:
            raise ValueError(f"read processes must be >= 0, not {self.read_procs}")
        if self.decode_procs < 0:
            raise ValueError(f"decode processes must be >= 0, not {self.decode_procs}")
        if self.ttft_budget_s is not None and not self.ttft_budget_s > 0:
            raise ValueError(f"the TTFT budget must be positive seconds, not {self.ttft_budget_s}")
        if not self.presets:
            raise ValueError(f"{PRESET.name} names no preset")
        if known_presets is None:
            return
        unknown = [p for p in self.presets + (self.allowed_presets or ()) if p not in known_presets]
        if unknown:
            raise ValueError(f"unknown preset(s) {unknown}; known: {', '.join(known_presets)}")
        # presets made from a model's calibration take its per-layer RoPE bases from it
        need_theta = [p for p in self.presets if known_presets[p].pre_rope and not getattr(known_presets[p], "needs_calibration", False)]
        if need_theta and self.rope_theta is None:
            raise ValueError(f"preset(s) {need_theta} quantise keys before RoPE: set {ROPE_THETA.name}")


_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([+-]?[0-9]+)|(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E))?$")
_SUFFIX = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity_bytes(text: str) -> int:
    """A byte count written as a pool's spec writes sizes (Kubernetes quantities: ``700Gi``,
    ``10G``, ``1.5Ti``, ``1e9``, a plain integer), rounded up to a whole byte; ``ValueError`` else."""
    found = _QUANTITY.match(text.strip())
    if not found:
        raise ValueError(f"not a size: {text!r} (an integer, or a quantity such as 700Gi or 10G)")
    number, exponent, suffix = found.groups()
    value = Decimal(number) * (Decimal(10) ** int(exponent) if exponent else _SUFFIX[suffix or ""])
    return int(value.to_integral_value(rounding=ROUND_CEILING))


def render() -> str:
    """``docs/configuration.md``: one table per component."""
    out = ["# Configuration", "",
           "Generated from `sidecar/kvfetcher/config.py` by `python -m kvfetcher.config > docs/configuration.md`.",
           "Every setting is an environment variable; unset or empty, it takes its default.", ""]
    for title, table in TABLES.items():
        injected = any(s.inject for s in table)
        head = ["Variable", "Type", "Default", "Meaning"] + (["Set by the operator from"] if injected else [])
        out += [f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for s in table:
            row = [f"`{s.name}`", _TYPES[s.type][0], s.shown_default(), s.doc]
            out.append("| " + " | ".join(row + ([s.inject] if injected else [])) + " |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
