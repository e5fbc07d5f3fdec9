"""Pod Security Standards, "restricted" profile (Kubernetes v1.30 policy version), as one pure function.

Every control of the published profile (kubernetes.io/docs/concepts/security/pod-security-standards),
baseline ones included, checked against a pod spec the way Pod Security admission checks it:
pod-level settings count for every container unless a container overrides them.
"""
from __future__ import annotations

from typing import Any

ALLOWED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                   "projected", "secret"}
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for key in ("initContainers", "containers", "ephemeralContainers") for c in spec.get(key) or []]


def _pod_level(spec: dict[str, Any]) -> list[str]:
    out = []
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            out.append(f"{key} is true")
    pod = spec.get("securityContext") or {}
    if (pod.get("windowsOptions") or {}).get("hostProcess"):
        out.append("pod hostProcess")
    for sysctl in pod.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"unsafe sysctl {sysctl.get('name')}")
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= ALLOWED_VOLUMES:
            out.append(f"volume {volume.get('name')} of type {sorted(kinds - ALLOWED_VOLUMES)}")
    if pod.get("runAsUser") == 0:
        out.append("pod runAsUser 0")
    return out


def _container(c: dict[str, Any], pod: dict[str, Any]) -> list[str]:
    name, sc = c.get("name"), c.get("securityContext") or {}
    out = []
    if sc.get("privileged"):
        out.append(f"{name}: privileged")
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        out.append(f"{name}: hostProcess")
    if any(p.get("hostPort") for p in c.get("ports") or []):
        out.append(f"{name}: hostPort")
    if sc.get("procMount", "Default") != "Default":
        out.append(f"{name}: procMount {sc['procMount']}")
    for level in (pod, sc):
        se = level.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"{name}: seLinuxOptions {se}")
        apparmor = (level.get("appArmorProfile") or {}).get("type")
        if apparmor not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"{name}: appArmorProfile {apparmor}")
    if sc.get("allowPrivilegeEscalation") is not False:
        out.append(f"{name}: allowPrivilegeEscalation must be false")
    non_root = sc.get("runAsNonRoot", pod.get("runAsNonRoot"))
    if non_root is not True:
        out.append(f"{name}: runAsNonRoot must be true")
    if sc.get("runAsUser") == 0:
        out.append(f"{name}: runAsUser 0")
    seccomp = (sc.get("seccompProfile") or pod.get("seccompProfile") or {}).get("type")
    if seccomp not in ("RuntimeDefault", "Localhost"):
        out.append(f"{name}: seccompProfile must be RuntimeDefault or Localhost")
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        out.append(f"{name}: capabilities must drop ALL")
    if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
        out.append(f"{name}: adds capabilities {caps['add']}")
    return out


def restricted_violations(spec: dict[str, Any]) -> list[str]:
    """Every way a pod spec breaks the restricted profile; empty when Pod Security admission would admit it."""
    pod = spec.get("securityContext") or {}
    return _pod_level(spec) + [v for c in _containers(spec) for v in _container(c, pod)]


def workload_pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod spec of a Pod, a workload controller or a CronJob; None for other kinds."""
    kind = obj.get("kind")
    if kind == "Pod":
        return obj["spec"]
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return obj["spec"]["template"]["spec"]
    if kind == "CronJob":
        return obj["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return None
