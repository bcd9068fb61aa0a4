"""Least privilege in deploy/k8s and compose.yaml, checked statically (docs/SECURITY.md):

* every Kubernetes pod is non-root, with a read-only root filesystem (writable paths only
  on emptyDir volumes, /tmp at least), no privilege escalation, capabilities ``drop: [ALL]``,
  seccomp ``RuntimeDefault``, no service-account token;
* the NetworkPolicies deny by default and allow exactly the flows the system needs: a
  small evaluator of the NetworkPolicy semantics (the subset these manifests use; anything
  else fails loudly) answers "may A reach B on port P" for a matrix of wanted and unwanted
  flows;
* credentials are Secrets mounted as files and handed over by path (``--*-file`` flags,
  compose secrets); none is a literal in a manifest, a command line, an environment
  variable or a Redis URL; Redis loads the ACL file rendered from the secret files; each
  process logs into Redis as its own ACL user.

Each checker is also fed deliberately broken copies (a missing NetworkPolicy, a pod
without readOnlyRootFilesystem or ``drop: [ALL]``, a credential as a literal or a
command-line argument...) and must report them, so a checker that silently checks
nothing fails here. No cluster and no Docker needed.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path
from typing import Callable

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
NS_LABEL = "kubernetes.io/metadata.name"
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
#: Which Redis ACL user each workload logs in as (deploy/redis/users.acl).
REDIS_USER = {"inflight-gateway": "gateway", "inflight-worker": "worker",
              "gateway": "gateway", "worker": "worker", "worker-cpu": "worker", "keys": "admin"}
#: Flag and variable names that carry a credential (unless they name a file).
CREDENTIAL_WORD = re.compile(r"pass(word)?|secret|token|api[-_]?key|requirepass|masterauth|auth", re.I)
URL_WITH_PASSWORD = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@:]*:[^/\s@]+@", re.I)


_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


@functools.lru_cache(maxsize=None)
def _load(path: Path) -> tuple:
    return tuple(d for d in yaml.load_all(path.read_text(), Loader=_LOADER) if d)


def k8s_docs() -> list[dict]:
    """Every object under deploy/k8s (a fresh copy: tests break them)."""
    return copy.deepcopy([d for f in sorted(K8S.glob("*.yaml")) for d in _load(f)])


def compose() -> dict:
    return copy.deepcopy(_load(ROOT / "compose.yaml")[0])


def namespace() -> str:
    return _load(K8S / "kustomization.yaml")[0]["namespace"]


def _workloads(docs: list[dict]) -> list[tuple[str, dict]]:
    """(name, pod template) of every workload."""
    out = []
    for d in docs:
        if d["kind"] in WORKLOADS:
            out.append((d["metadata"]["name"], d["spec"]["template"]))
    return out


def _containers(pod: dict) -> list[dict]:
    return [*pod.get("initContainers", []), *pod["containers"]]


# ------------------------------------------------------------------ pod security

def pod_security_problems(docs: list[dict]) -> list[str]:
    """What keeps a pod from the restricted, read-only baseline (empty: none)."""
    problems = []
    for name, template in _workloads(docs):
        pod = template["spec"]
        psc = pod.get("securityContext", {})
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if pod.get(flag):
                problems.append(f"{name}: {flag}")
        if pod.get("automountServiceAccountToken") is not False:
            problems.append(f"{name}: automountServiceAccountToken is not false (no pod talks to the API)")
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for c in _containers(pod):
            where = f"{name}/{c['name']}"
            csc = c.get("securityContext", {})

            def effective(key: str, csc=csc):
                return csc.get(key, psc.get(key))

            if effective("runAsNonRoot") is not True:
                problems.append(f"{where}: runAsNonRoot is not true")
            if effective("runAsUser") == 0 or effective("runAsGroup") == 0:
                problems.append(f"{where}: runs as root (user or group 0)")
            if csc.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{where}: allowPrivilegeEscalation is not false")
            if csc.get("privileged"):
                problems.append(f"{where}: privileged")
            if csc.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{where}: readOnlyRootFilesystem is not true")
            caps = csc.get("capabilities", {})
            if "ALL" not in caps.get("drop", []):
                problems.append(f"{where}: capabilities do not drop ALL")
            if caps.get("add"):
                problems.append(f"{where}: adds capabilities {caps['add']}")
            if (effective("seccompProfile") or {}).get("type") != "RuntimeDefault":
                problems.append(f"{where}: seccompProfile is not RuntimeDefault")
            mounts = {m["mountPath"]: m for m in c.get("volumeMounts", [])}
            tmp = mounts.get("/tmp")
            if tmp is None or "emptyDir" not in volumes.get(tmp["name"], {}):
                problems.append(f"{where}: /tmp is not an emptyDir (the root filesystem is read-only)")
            for path, m in mounts.items():
                source = volumes.get(m["name"], {})
                if not m.get("readOnly") and not ({"emptyDir", "persistentVolumeClaim", "ephemeral"} & set(source)):
                    problems.append(f"{where}: {path} is mounted writable from {sorted(source)}")
    return problems


# ------------------------------------------------------------------ credentials

def _flag_problems(where: str, words: list[str]) -> list[str]:
    """A credential in a command line: a ``--password=x`` / ``--link-secret x`` style flag
    (one that does not name a file), or a URL with a password in it."""
    problems = []
    for i, word in enumerate(map(str, words)):
        if URL_WITH_PASSWORD.search(word):
            problems.append(f"{where}: a password inside a URL on the command line: {word!r}")
        if word.startswith("-"):
            flag = word.lstrip("-").split("=", 1)[0]
            if CREDENTIAL_WORD.search(flag) and not flag.endswith("-file") and flag != "aclfile":
                problems.append(f"{where}: credential flag on the command line: {flag!r}")
    return problems


def _env_problems(where: str, name: str, value, from_secret: bool) -> list[str]:
    if not CREDENTIAL_WORD.search(name):
        return []
    if name.endswith("_FILE") or name.endswith("__FILE"):  # a path (Grafana's __FILE convention too)
        return [] if value is None or str(value).startswith("/") else [f"{where}: {name} is not a path"]
    if from_secret:
        return [f"{where}: {name} comes from a Secret as an environment variable, not as a file"]
    return [f"{where}: {name} is a literal credential in the environment"]


def _secret_files(pod: dict, container: dict) -> dict[str, tuple[str, str]]:
    """Path -> (Secret name, key) of every file a container gets from a Secret."""
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        vol = volumes.get(m["name"], {})
        sources = []
        if "secret" in vol:
            sources.append(vol["secret"] | {"name": vol["secret"]["secretName"]})
        for src in vol.get("projected", {}).get("sources", []):
            if "secret" in src:
                sources.append(src["secret"])
        for secret in sources:
            for item in secret.get("items", []):
                out[f"{m['mountPath'].rstrip('/')}/{item['path']}"] = (secret["name"], item["key"])
    return out


def _flag_value(words: list[str], flag: str) -> str | None:
    for i, word in enumerate(words):
        if word == flag and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return None


def k8s_credential_problems(docs: list[dict]) -> list[str]:
    """Credentials that are literals, command-line arguments or environment variables, or
    that a process lacks; empty when every credential is a Secret mounted as a file."""
    problems = []
    generated = set()
    for d in docs:
        if d["kind"] == "Secret":
            problems.append(f"Secret {d['metadata']['name']}: a credential in a manifest "
                            "(use the kustomization's secretGenerator files)")
        if d["kind"] == "Kustomization":
            for gen in d.get("secretGenerator", []):
                generated.add(gen["name"])
                if gen.get("literals") or gen.get("envs"):
                    problems.append(f"secretGenerator {gen['name']}: literals/envs (files only)")
        if d["kind"] == "ConfigMap":
            for key, text in d.get("data", {}).items():
                for line in text.splitlines():
                    if line.startswith("user ") and re.search(r"(^|\s)(>\S|#[0-9a-f]{64}\b)", line):
                        problems.append(f"ConfigMap {d['metadata']['name']}/{key}: a password or its hash")
        if d["kind"] == "ScaledObject":
            for t in d["spec"]["triggers"]:
                for key in t.get("metadata", {}):
                    if CREDENTIAL_WORD.search(key) and not key.endswith("FromEnv"):
                        problems.append(f"ScaledObject trigger: credential {key!r} in its metadata")
    for name, template in _workloads(docs):
        pod = template["spec"]
        for c in _containers(pod):
            where = f"{name}/{c['name']}"
            words = [str(w) for w in (*c.get("command", []), *c.get("args", []))]
            problems += _flag_problems(where, words)
            for env in c.get("env", []):
                from_secret = "secretKeyRef" in env.get("valueFrom", {})
                problems += _env_problems(where, env["name"], env.get("value"), from_secret)
            for source in c.get("envFrom", []):
                if "secretRef" in source:
                    problems.append(f"{where}: envFrom a Secret (credentials as files only)")
            files = _secret_files(pod, c)
            if name in ("inflight-gateway", "inflight-worker"):
                for flag, secret in (("--link-secret-file", "inflight-link"),
                                     ("--redis-password-file", "inflight-redis-passwords")):
                    path = _flag_value(words, flag)
                    if path is None:
                        problems.append(f"{where}: no {flag}")
                    elif files.get(path, ("",))[0] != secret:
                        problems.append(f"{where}: {flag} {path} is not a file of the Secret {secret}")
                password_key = files.get(_flag_value(words, "--redis-password-file") or "", ("", ""))[1]
                url = _flag_value(words, "--redis-url") or ""
                user = REDIS_USER[name]
                if not re.match(rf"rediss?(\+sentinel)?://{user}@", url):  # plain or through Sentinel
                    problems.append(f"{where}: --redis-url does not log in as the ACL user {user!r}: {url!r}")
                if password_key and password_key != user:
                    problems.append(f"{where}: reads the password of {password_key!r}, not of {user!r}")
            if name == "inflight-redis":
                if "--aclfile" not in words:
                    problems.append(f"{where}: redis-server without --aclfile")
                pattern = next((w for w in words if "%s" in w), None)
                keys = {key for path, (secret, key) in files.items()
                        if secret == "inflight-redis-passwords" and pattern and path == pattern % key}
                if not {"gateway", "worker", "admin", "keda"} <= keys:  # + the Sentinel variant's users
                    problems.append(f"{where}: the ACL is not rendered from every password file ({sorted(keys)})")
    for name, template in _workloads(docs):
        for vol in template["spec"].get("volumes", []):
            names = [vol["secret"]["secretName"]] if "secret" in vol else [
                s["secret"]["name"] for s in vol.get("projected", {}).get("sources", []) if "secret" in s]
            for secret in names:
                if secret not in generated:
                    problems.append(f"{name}: mounts the Secret {secret}, which the kustomization does not generate")
    return problems


def compose_credential_problems(doc: dict) -> list[str]:
    """The same for compose.yaml: compose secrets (from a variable or a file, never
    ``content``), handed over by path; each service on its own Redis user."""
    problems = []
    declared = doc.get("secrets", {})
    for name, secret in declared.items():
        if "content" in secret or not ({"environment", "file"} & set(secret)):
            problems.append(f"secret {name}: not from a variable or a file")
    for name, service in doc["services"].items():
        words = [str(w) for w in (*service.get("entrypoint", []), *service.get("command", []))]
        problems += _flag_problems(name, words)
        env = service.get("environment", {})
        items = env.items() if isinstance(env, dict) else (e.partition("=")[::2] for e in env)
        for key, value in items:
            problems += _env_problems(name, key, value, from_secret=False)
        mounted = {s if isinstance(s, str) else s["source"] for s in service.get("secrets", [])}
        if mounted - set(declared):
            problems.append(f"{name}: undeclared secrets {sorted(mounted - set(declared))}")
        if name in ("gateway", "worker", "worker-cpu", "keys"):
            flags = ("--redis-password-file",) if name == "keys" else ("--redis-password-file", "--link-secret-file")
            for flag in flags:
                path = _flag_value(words, flag)
                if path is None or not path.startswith("/run/secrets/") or path.rsplit("/", 1)[1] not in mounted:
                    problems.append(f"{name}: {flag} is not one of its compose secrets ({path!r})")
            user = REDIS_USER[name]
            url = _flag_value(words, "--redis-url") or ""
            if not re.match(rf"rediss?(\+sentinel)?://{user}@", url):  # plain or through Sentinel
                problems.append(f"{name}: --redis-url does not log in as the ACL user {user!r}: {url!r}")
            password = _flag_value(words, "--redis-password-file") or ""
            if f"redis_{user}_password" not in password:
                problems.append(f"{name}: reads {password!r}, not the password of {user!r}")
        if name == "redis":
            if "--aclfile" not in words:
                problems.append("redis: redis-server without --aclfile")
            if str(service.get("user", "root")) in ("root", "0", "0:0"):
                problems.append("redis: runs as root")
            pattern = next((w for w in words if "%s" in w), "")
            for role in ("gateway", "worker", "admin"):
                if not pattern.startswith("/run/secrets/") or (pattern % role).rsplit("/", 1)[1] not in mounted:
                    problems.append(f"redis: the ACL is not rendered from the compose secret of {role!r}")
    return problems


# ------------------------------------------------------------------ network

class Endpoint:
    """A pod (its namespace's labels and its own) or, with ``ns`` None, something that is
    not a pod (the internet)."""

    def __init__(self, name: str, ns: str | None, labels: dict[str, str]):
        self.name, self.ns, self.labels = name, ns, labels

    @property
    def ns_labels(self) -> dict[str, str]:
        return {NS_LABEL: self.ns} if self.ns else {}

    def __repr__(self) -> str:
        return self.name


def _matches(selector: dict | None, labels: dict[str, str]) -> bool:
    if set(selector or {}) - {"matchLabels"}:
        raise NotImplementedError(f"the evaluator knows matchLabels only, not {selector}")
    return all(labels.get(k) == v for k, v in (selector or {}).get("matchLabels", {}).items())


def _peer_matches(peer: dict, endpoint: Endpoint, policy_ns: str) -> bool:
    if set(peer) - {"podSelector", "namespaceSelector"}:
        raise NotImplementedError(f"the evaluator knows pod and namespace selectors only, not {peer}")
    if endpoint.ns is None:
        return False
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], endpoint.ns_labels):
            return False
    elif endpoint.ns != policy_ns:
        return False
    return _matches(peer.get("podSelector"), endpoint.labels)


def _port_matches(ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if set(p) - {"port", "protocol", "endPort"}:
            raise NotImplementedError(p)
        if not isinstance(p.get("port", 0), int):
            raise NotImplementedError(f"named ports: {p}")
        if p.get("protocol", "TCP") == protocol and ("port" not in p or p["port"] <= port <= p.get("endPort", p["port"])):
            return True
    return False


def _policy_types(policy: dict) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress", *(["Egress"] if "egress" in spec else [])]


def _side_allows(policies: list[dict], subject: Endpoint, other: Endpoint, port: int, protocol: str,
                 direction: str, ns: str) -> bool:
    """Does ``subject``'s own side let this connection through (``direction`` Ingress:
    ``other`` connects to ``subject``; Egress: ``subject`` connects to ``other``)?"""
    if subject.ns != ns:
        return True  # outside the namespace: not ours to restrict
    selecting = [p for p in policies if direction in _policy_types(p) and _matches(p["spec"]["podSelector"], subject.labels)]
    if not selecting:
        return True
    key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
    for policy in selecting:
        for rule in policy["spec"].get(key) or []:
            peers = rule.get(peers_key)
            if (not peers or any(_peer_matches(peer, other, ns) for peer in peers)) and \
                    _port_matches(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(docs: list[dict], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """May ``src`` open a connection to ``dst`` on ``port`` under these NetworkPolicies?"""
    ns = namespace()
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    return (_side_allows(policies, src, dst, port, protocol, "Egress", ns)
            and _side_allows(policies, dst, src, port, protocol, "Ingress", ns))


def endpoints(docs: list[dict]) -> dict[str, Endpoint]:
    """Our pods (by component), the peers network-policies.yaml names, and strangers."""
    ns = namespace()
    out = {}
    for name, template in _workloads(docs):
        labels = template["metadata"]["labels"]
        out[labels["app.kubernetes.io/component"]] = Endpoint(name, ns, labels)
    out |= {
        "edge": Endpoint("edge pod", ns, {"app.kubernetes.io/component": "edge"}),
        "ingress-nginx": Endpoint("ingress-nginx", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
        "prometheus": Endpoint("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
        "keda": Endpoint("keda-operator", "keda", {"app.kubernetes.io/name": "keda-operator"}),
        "dns": Endpoint("kube-dns", "kube-system", {"k8s-app": "kube-dns"}),
        "stranger": Endpoint("another pod in the namespace", ns, {"app": "debug"}),
        "outsider": Endpoint("a pod of another namespace", "default", {"app": "web"}),
        "internet": Endpoint("the internet", None, {}),
    }
    return out


#: (source, destination, port, protocol) that must be open.
WANTED = [
    ("internet", "edge", 8080, "TCP"), ("outsider", "edge", 8081, "TCP"),
    ("edge", "gateway", 8000, "TCP"), ("edge", "gateway", 50051, "TCP"),
    ("ingress-nginx", "gateway", 8000, "TCP"), ("ingress-nginx", "gateway", 50051, "TCP"),
    ("worker", "gateway", 50052, "TCP"),
    ("gateway", "redis", 6379, "TCP"), ("worker", "redis", 6379, "TCP"), ("keda", "redis", 6379, "TCP"),
    ("prometheus", "gateway", 8000, "TCP"), ("prometheus", "worker", 9100, "TCP"),
    *((pod, "dns", 53, proto) for pod in ("gateway", "worker", "redis") for proto in ("UDP", "TCP")),
]
#: ... and a sample of what must stay shut.
UNWANTED = [
    ("internet", "edge", 22, "TCP"), ("edge", "internet", 443, "TCP"), ("edge", "stranger", 80, "TCP"),
    ("edge", "gateway", 50052, "TCP"), ("edge", "redis", 6379, "TCP"), ("edge", "worker", 9100, "TCP"),
    ("ingress-nginx", "gateway", 50052, "TCP"), ("ingress-nginx", "redis", 6379, "TCP"),
    ("stranger", "gateway", 8000, "TCP"), ("stranger", "gateway", 50052, "TCP"),
    ("stranger", "redis", 6379, "TCP"), ("stranger", "worker", 9100, "TCP"),
    ("outsider", "gateway", 8000, "TCP"), ("outsider", "gateway", 50052, "TCP"), ("outsider", "redis", 6379, "TCP"),
    ("outsider", "stranger", 80, "TCP"),  # the default deny covers pods nobody wrote a policy for
    ("stranger", "internet", 443, "TCP"),
    ("gateway", "worker", 9100, "TCP"), ("gateway", "internet", 443, "TCP"), ("gateway", "stranger", 80, "TCP"),
    ("worker", "gateway", 8000, "TCP"), ("worker", "worker", 9101, "TCP"), ("worker", "internet", 443, "TCP"),
    ("redis", "gateway", 50052, "TCP"), ("redis", "internet", 443, "TCP"),
    ("prometheus", "redis", 6379, "TCP"), ("prometheus", "worker", 9101, "TCP"),
    ("keda", "gateway", 8000, "TCP"), ("gateway", "dns", 80, "TCP"),
]


#: ... and what each destination's own ingress rules must refuse, whatever the source's
#: egress rules say (a pod someone gives an allow-all egress policy later).
UNWANTED_INGRESS = [
    ("stranger", "redis", 6379), ("stranger", "gateway", 8000), ("stranger", "gateway", 50051),
    ("stranger", "gateway", 50052), ("stranger", "worker", 9100), ("stranger", "worker", 9101),
    ("outsider", "redis", 6379), ("outsider", "gateway", 50052), ("edge", "redis", 6379),
    ("edge", "gateway", 50052), ("prometheus", "redis", 6379), ("gateway", "worker", 9100),
]


def network_problems(docs: list[dict]) -> list[str]:
    """Wanted flows that are shut, unwanted ones that are open, a missing default deny."""
    problems = []
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    if not any(p["spec"]["podSelector"] in ({}, None) and set(_policy_types(p)) == {"Ingress", "Egress"}
               and not p["spec"].get("ingress") and not p["spec"].get("egress") for p in policies):
        problems.append("no default-deny NetworkPolicy (empty podSelector, Ingress and Egress, no rules)")
    ends = endpoints(docs)
    for src, dst, port, proto in WANTED:
        if not allowed(docs, ends[src], ends[dst], port, proto):
            problems.append(f"shut: {ends[src]} -> {ends[dst]}:{port}/{proto}")
    for src, dst, port, proto in UNWANTED:
        if allowed(docs, ends[src], ends[dst], port, proto):
            problems.append(f"open: {ends[src]} -> {ends[dst]}:{port}/{proto}")
    for src, dst, port in UNWANTED_INGRESS:
        if _side_allows(policies, ends[dst], ends[src], port, "TCP", "Ingress", namespace()):
            problems.append(f"{ends[dst]} lets {ends[src]} in on {port}")
    for name, template in [*_workloads(docs), ("edge", {"metadata": {"labels": ends["edge"].labels}})]:
        labels = template["metadata"]["labels"]
        own = [p for p in policies if p["spec"]["podSelector"] not in ({}, None)
               and _matches(p["spec"]["podSelector"], labels)]
        if not own:
            problems.append(f"{name}: no NetworkPolicy of its own")
    return problems


# ================================================================== the real files

def test_every_pod_is_non_root_read_only_and_without_capabilities():
    assert {n for n, _ in _workloads(k8s_docs())} == {"inflight-redis", "inflight-gateway", "inflight-worker"}
    assert pod_security_problems(k8s_docs()) == []


def test_the_namespace_enforces_the_restricted_pod_security_standard():
    ns = next(d for d in k8s_docs() if d["kind"] == "Namespace")
    assert ns["metadata"]["name"] == namespace()
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


def test_network_policies_allow_exactly_the_needed_flows():
    assert network_problems(k8s_docs()) == []


def test_k8s_credentials_are_secret_files_passed_by_path():
    assert k8s_credential_problems(k8s_docs()) == []


def test_compose_credentials_are_secret_files_passed_by_path():
    assert compose_credential_problems(compose()) == []


def test_no_credential_file_is_committed():
    """The secretGenerator's sources stay out of git (secrets/.gitignore ignores all but itself)."""
    ignore = (K8S / "secrets" / ".gitignore").read_text().split()
    assert "*" in ignore and "!.gitignore" in ignore
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for gen in kustomization["secretGenerator"]:
        assert gen.get("files") and all(f.split("=", 1)[-1].startswith("secrets/") for f in gen["files"]), gen


# ================================================================== broken copies

def _pod(docs: list[dict], name: str) -> dict:
    return next(t["spec"] for n, t in _workloads(docs) if n == name)


def _container(docs: list[dict], name: str) -> dict:
    return _pod(docs, name)["containers"][0]


POD_BREAKAGES: dict[str, Callable[[dict], None]] = {
    "writable root filesystem": lambda pod: pod["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"),
    "capabilities kept": lambda pod: pod["containers"][0]["securityContext"].pop("capabilities"),
    "a capability added": lambda pod: pod["containers"][0]["securityContext"]["capabilities"].update(add=["NET_RAW"]),
    "may escalate": lambda pod: pod["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
    "root": lambda pod: pod["containers"][0]["securityContext"].update(runAsUser=0),
    "may run as root": lambda pod: (pod["securityContext"].pop("runAsNonRoot"),
                                    pod["containers"][0]["securityContext"].pop("runAsNonRoot")),
    "no seccomp": lambda pod: (pod["securityContext"].pop("seccompProfile"),
                               pod["containers"][0]["securityContext"].pop("seccompProfile")),
    "unconfined seccomp": lambda pod: pod["containers"][0]["securityContext"].update(
        seccompProfile={"type": "Unconfined"}),
    "no /tmp": lambda pod: pod["containers"][0].update(
        volumeMounts=[m for m in pod["containers"][0]["volumeMounts"] if m["mountPath"] != "/tmp"]),
    "token mounted": lambda pod: pod.pop("automountServiceAccountToken"),
    "host network": lambda pod: pod.update(hostNetwork=True),
    "privileged sidecar": lambda pod: pod["containers"].append(
        {"name": "sidecar", "image": "busybox", "securityContext": {"privileged": True}}),
}


@pytest.mark.parametrize("workload", ["inflight-redis", "inflight-gateway", "inflight-worker"])
@pytest.mark.parametrize("breakage", sorted(POD_BREAKAGES))
def test_pod_security_check_rejects_a_broken_pod(workload, breakage):
    docs = copy.deepcopy(k8s_docs())
    POD_BREAKAGES[breakage](_pod(docs, workload))
    assert pod_security_problems(docs), f"{workload} with {breakage} passed"


@pytest.mark.parametrize("policy", sorted(d["metadata"]["name"] for d in k8s_docs() if d["kind"] == "NetworkPolicy"))
def test_network_check_rejects_a_missing_network_policy(policy):
    docs = [d for d in k8s_docs() if not (d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == policy)]
    assert network_problems(docs), f"without {policy} nothing changed"


def _policy(docs: list[dict], name: str) -> dict:
    return next(d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] == name)


NETWORK_BREAKAGES: dict[str, Callable[[list[dict]], None]] = {
    "worker cannot reach the link": lambda docs: _policy(docs, "inflight-worker")["spec"]["egress"].pop(1),
    "gateway cannot reach Redis": lambda docs: _policy(docs, "inflight-gateway")["spec"].pop("egress"),
    "link port open to the edge": lambda docs: _policy(docs, "inflight-gateway")["spec"]["ingress"][0]["ports"].append(
        {"protocol": "TCP", "port": 50052}),
    "Redis open to every pod of the namespace": lambda docs: _policy(docs, "inflight-redis")["spec"]["ingress"][0][
        "from"].append({"podSelector": {}}),
    "Redis open to every port and peer": lambda docs: _policy(docs, "inflight-redis")["spec"].update(ingress=[{}]),
    "worker egress anywhere": lambda docs: _policy(docs, "inflight-worker")["spec"]["egress"].append({}),
    "default deny only for ingress": lambda docs: _policy(docs, "default-deny")["spec"].update(policyTypes=["Ingress"]),
    "Prometheus on the gateway's gRPC port instead": lambda docs: _policy(docs, "inflight-gateway")["spec"][
        "ingress"][2].update(ports=[{"protocol": "TCP", "port": 50051}]),
    "DNS over UDP only to the wrong namespace": lambda docs: _policy(docs, "allow-dns-egress")["spec"]["egress"][0][
        "to"][0]["namespaceSelector"].update(matchLabels={NS_LABEL: "default"}),
}


@pytest.mark.parametrize("breakage", sorted(NETWORK_BREAKAGES))
def test_network_check_rejects_a_wrong_rule(breakage):
    docs = copy.deepcopy(k8s_docs())
    NETWORK_BREAKAGES[breakage](docs)
    assert network_problems(docs), breakage


def test_the_evaluator_refuses_selectors_it_does_not_know():
    docs = copy.deepcopy(k8s_docs())
    _policy(docs, "inflight-redis")["spec"]["ingress"][0]["from"][0]["podSelector"] = {
        "matchExpressions": [{"key": "app", "operator": "Exists"}]}
    with pytest.raises(NotImplementedError):
        network_problems(docs)


def _add_arg(name: str, arg: str) -> Callable[[list[dict]], None]:
    return lambda docs: _container(docs, name)["args"].append(arg)


def _add_env(name: str, env: dict) -> Callable[[list[dict]], None]:
    return lambda docs: _container(docs, name).setdefault("env", []).append(env)


def _drop_arg(name: str, prefix: str) -> Callable[[list[dict]], None]:
    def drop(docs):
        c = _container(docs, name)
        c["args"] = [a for a in c["args"] if not a.startswith(prefix)]
    return drop


def _replace_arg(name: str, prefix: str, value: str) -> Callable[[list[dict]], None]:
    def replace(docs):
        c = _container(docs, name)
        c["args"] = [value if a.startswith(prefix) else a for a in c["args"]]
    return replace


K8S_CREDENTIAL_BREAKAGES: dict[str, Callable[[list[dict]], None]] = {
    "password in the Redis URL": _replace_arg(
        "inflight-gateway", "--redis-url=", "--redis-url=redis://gateway:hunter2@inflight-redis:6379/0"),
    "link secret as an argument": _add_arg("inflight-worker", "--link-secret=s3cr3t"),
    "requirepass on the command line": _add_arg("inflight-redis", "--requirepass"),
    "literal secret in the environment": _add_env("inflight-worker", {"name": "INFLIGHT_LINK_SECRET", "value": "s3cr3t"}),
    "password from a Secret as an environment variable": _add_env(
        "inflight-gateway", {"name": "REDIS_PASSWORD", "valueFrom": {
            "secretKeyRef": {"name": "inflight-redis-passwords", "key": "gateway"}}}),
    "envFrom a Secret": lambda docs: _container(docs, "inflight-gateway").update(
        envFrom=[{"secretRef": {"name": "inflight-link"}}]),
    "worker without the link secret": _drop_arg("inflight-worker", "--link-secret-file"),
    "gateway without its Redis password": _drop_arg("inflight-gateway", "--redis-password-file"),
    "password file not from a Secret": _replace_arg(
        "inflight-gateway", "--redis-password-file=", "--redis-password-file=/tmp/redis-password"),
    "gateway logs in as the worker": _replace_arg(
        "inflight-gateway", "--redis-url=", "--redis-url=redis://worker@inflight-redis:6379/0"),
    "gateway logs in as nobody": _replace_arg(
        "inflight-gateway", "--redis-url=", "--redis-url=redis://inflight-redis:6379/0"),
    "Redis without the ACL file": lambda docs: _container(docs, "inflight-redis").update(args=["--appendonly", "yes"]),
    "a Secret in the manifests": lambda docs: docs.append(
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "x"}, "stringData": {"password": "hunter2"}}),
    "a literal in the secretGenerator": lambda docs: next(d for d in docs if d["kind"] == "Kustomization")[
        "secretGenerator"].append({"name": "more", "literals": ["password=hunter2"]}),
    "a password in the ACL ConfigMap": lambda docs: next(
        d for d in docs if d["kind"] == "ConfigMap" and "users.acl" in d.get("data", {}))["data"].update(
        {"users.acl": "user gateway on >hunter2 ~* +@all\n"}),
    "a password in KEDA's trigger": lambda docs: next(d for d in docs if d["kind"] == "ScaledObject")["spec"][
        "triggers"][0]["metadata"].update(password="hunter2"),
}


@pytest.mark.parametrize("breakage", sorted(K8S_CREDENTIAL_BREAKAGES))
def test_k8s_credential_check_rejects_a_broken_copy(breakage):
    docs = copy.deepcopy(k8s_docs())
    K8S_CREDENTIAL_BREAKAGES[breakage](docs)
    assert k8s_credential_problems(docs), breakage


COMPOSE_BREAKAGES: dict[str, Callable[[dict], None]] = {
    "a secret with literal content": lambda c: c["secrets"].update(link_secret={"content": "s3cr3t"}),
    "password in the Redis URL": lambda c: c["services"]["gateway"]["command"].extend(
        ["--redis-url", "redis://gateway:hunter2@redis:6379/0"]),
    "literal secret in the environment": lambda c: c["services"]["worker"].update(
        environment={"INFLIGHT_LINK_SECRET": "s3cr3t"}),
    "requirepass for Redis": lambda c: c["services"]["redis"]["command"].extend(["--requirepass", "hunter2"]),
    "gateway without the link secret": lambda c: c["services"]["gateway"].update(
        command=[w for w in c["services"]["gateway"]["command"] if w != "--link-secret-file"]),
    "worker without its secrets": lambda c: c["services"]["worker"].pop("secrets"),
    "Redis without its password files": lambda c: c["services"]["redis"].pop("secrets"),
    "Redis without the ACL file": lambda c: c["services"]["redis"].update(command=["--appendonly", "yes"]),
    "Redis as root": lambda c: c["services"]["redis"].pop("user"),
    "worker as the gateway user": lambda c: c["services"]["worker-cpu"].update(command=[
        "redis://gateway@redis:6379/0" if w.startswith("redis://") else w for w in c["services"]["worker-cpu"]["command"]]),
    "admin password in the gateway": lambda c: c["services"]["gateway"].update(command=[
        "/run/secrets/redis_admin_password" if w == "/run/secrets/redis_gateway_password" else w
        for w in c["services"]["gateway"]["command"]]),
}


@pytest.mark.parametrize("breakage", sorted(COMPOSE_BREAKAGES))
def test_compose_credential_check_rejects_a_broken_copy(breakage):
    doc = copy.deepcopy(compose())
    COMPOSE_BREAKAGES[breakage](doc)
    assert compose_credential_problems(doc), breakage
