"""deploy/: Kubernetes manifests (kustomize base + cpu overlay), systemd units, Dockerfiles.

Everything is checked offline and without a cluster, a Docker engine or kubectl:
- the kustomizations are rendered here (resources, namespace, images, JSON 6902 patches) and every object
  is validated against the Kubernetes JSON schemas shipped by `kubernetes-validate`, in strict mode
  (unknown fields fail); when `kubectl` is on PATH the render is also compared with `kubectl kustomize`;
- systemd units are parsed (and run through `systemd-analyze verify` where it exists); Dockerfiles get a
  structural check.
"""

from __future__ import annotations

import copy
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S_BASE = DEPLOY / "k8s" / "base"
K8S_CPU = DEPLOY / "k8s" / "overlays" / "cpu"
SYSTEMD = DEPLOY / "systemd"
DOCKER = DEPLOY / "docker"

# Oldest Kubernetes minor we claim to support, and the newest whose schemas the package ships.
K8S_VERSIONS = ["1.29.0", "latest"]
NAMESPACE = "relayout"
DATA_DIR = "/var/lib/relayout"
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass"}
WORKLOADS = {"Deployment", "DaemonSet", "StatefulSet", "Job"}


# ---- a small offline kustomize ----------------------------------------------------------------------
def _json_pointer(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for raw in path.lstrip("/").split("/"):
        tok = raw.replace("~1", "/").replace("~0", "~")
        parts.append(int(tok) if tok.isdigit() else tok)
    return parts


def _apply_json6902(doc: dict, ops: list[dict]) -> None:
    for op in ops:
        *parent_path, last = _json_pointer(op["path"])
        parent = doc
        for p in parent_path:
            parent = parent[p]
        kind = op["op"]
        if kind == "remove":
            del parent[last]  # KeyError/IndexError: the patch targets nothing, as kustomize would fail
        elif kind == "replace":
            parent[last]  # must exist
            parent[last] = copy.deepcopy(op["value"])
        elif kind == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(f"unsupported patch op {kind!r}")


def _matches(target: dict, doc: dict) -> bool:
    group, _, version = doc["apiVersion"].rpartition("/")
    return (target.get("kind", doc["kind"]) == doc["kind"]
            and target.get("name", doc["metadata"]["name"]) == doc["metadata"]["name"]
            and target.get("group", group) == group
            and target.get("version", version) == version)


def _pod_containers(doc: dict) -> list[dict]:
    if doc["kind"] not in WORKLOADS:
        return []
    spec = doc["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def render(kdir: Path) -> list[dict]:
    k = yaml.safe_load((kdir / "kustomization.yaml").read_text())
    unknown = set(k) - {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
    assert not unknown, f"{kdir}: kustomization fields this renderer does not model: {unknown}"
    assert k["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and k["kind"] == "Kustomization"
    docs: list[dict] = []
    for res in k["resources"]:
        path = (kdir / res).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in k.get("patches", []):
        hits = [d for d in docs if _matches(patch["target"], d)]
        assert hits, f"{kdir}: patch target {patch['target']} matches nothing"
        for d in hits:
            _apply_json6902(d, yaml.safe_load(patch["patch"]))
    for img in k.get("images", []):
        for d in docs:
            for c in _pod_containers(d):
                name, tag = c["image"].split("@")[0], None
                if ":" in name.rsplit("/", 1)[-1]:
                    name, tag = name.rsplit(":", 1)
                if name == img["name"]:
                    c["image"] = f"{img.get('newName', name)}:{img.get('newTag', tag)}" if (
                        img.get("newTag") or tag) else img.get("newName", name)
    if "namespace" in k:
        for d in docs:
            if d["kind"] not in CLUSTER_SCOPED:
                d["metadata"]["namespace"] = k["namespace"]
    return docs


@pytest.fixture(scope="module", params=["base", "cpu"])
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(K8S_BASE if request.param == "base" else K8S_CPU)


def _by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def _one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


# ---- Kubernetes ------------------------------------------------------------------------------------------
def test_k8s_schema_strict(rendered):
    kv = pytest.importorskip("kubernetes_validate")
    _, docs = rendered
    versions = [str(kv.utils.latest_version()) if v == "latest" else v for v in K8S_VERSIONS]
    for version in versions:
        for d in docs:
            where = f"{d['kind']}/{d['metadata']['name']} (k8s {version})"
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as e:
                pytest.fail(f"{where}: {e}")


def test_k8s_strict_mode_rejects_unknown_fields():
    """Negative control: the validator really is strict, so a typo in a manifest cannot slip by."""
    kv = pytest.importorskip("kubernetes_validate")
    ds = copy.deepcopy(_one(render(K8S_BASE), "DaemonSet", "relayout-agent"))
    ds["spec"]["template"]["spec"]["hostNetwrok"] = True
    with pytest.raises(kv.ValidationError):
        kv.validate(ds, K8S_VERSIONS[0], strict=True)


def test_k8s_render_matches_kubectl_kustomize():
    kubectl = shutil.which("kubectl")
    if not kubectl:
        pytest.skip("kubectl not installed; the offline renderer is the only check")
    for kdir in (K8S_BASE, K8S_CPU):
        try:
            out = subprocess.run([kubectl, "kustomize", str(kdir)], capture_output=True, text=True,
                                 timeout=30, check=True).stdout
        except (subprocess.SubprocessError, OSError) as e:
            pytest.skip(f"kubectl kustomize unusable here: {e}")
        theirs = [d for d in yaml.safe_load_all(out) if d]
        key = lambda d: (d["kind"], d["metadata"]["name"])  # noqa: E731
        assert sorted(theirs, key=key) == sorted(render(kdir), key=key), kdir


def test_k8s_inventory_and_namespace(rendered):
    _, docs = rendered
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for need in [("Namespace", NAMESPACE), ("DaemonSet", "relayout-agent"), ("Service", "relayout-agent"),
                 ("Deployment", "relayout-gateway"), ("Service", "relayout-gateway"),
                 ("Deployment", "relayout-controller"), ("ServiceAccount", "relayout-controller"),
                 ("ConfigMap", "relayout-config"), ("Secret", "relayout-token")]:
        assert need in kinds, need
    assert len(kinds) == len(docs), "duplicate kind/name"
    for d in docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == NAMESPACE, d["metadata"]["name"]
        for s in d.get("subjects", []):
            if s["kind"] == "ServiceAccount":
                assert s.get("namespace") == NAMESPACE


def test_k8s_references_resolve(rendered):
    """Every ConfigMap/Secret key, ServiceAccount and Service selector points at something that exists."""
    _, docs = rendered
    cms = {d["metadata"]["name"]: d.get("data", {}) for d in _by_kind(docs, "ConfigMap")}
    secrets = {d["metadata"]["name"]: {**d.get("data", {}), **d.get("stringData", {})}
               for d in _by_kind(docs, "Secret")}
    sas = {d["metadata"]["name"] for d in _by_kind(docs, "ServiceAccount")}
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        spec = w["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] in sas
        assert w["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
        for v in spec.get("volumes", []):
            if "configMap" in v:
                for item in v["configMap"].get("items", []):
                    assert item["key"] in cms[v["configMap"]["name"]], item
        mounts = {m["name"] for c in _pod_containers(w) for m in c.get("volumeMounts", [])}
        assert mounts <= {v["name"] for v in spec.get("volumes", [])}
        for c in _pod_containers(w):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {})
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["key"] in cms[ref["configMapKeyRef"]["name"]], e
                if "secretKeyRef" in ref:
                    assert ref["secretKeyRef"]["key"] in secrets[ref["secretKeyRef"]["name"]], e
            # $(VAR) in args must name an env var of the container, else Kubernetes passes it literally
            names = {e["name"] for e in c.get("env", [])}
            for a in c.get("args", []) + c.get("command", []):
                for var in re.findall(r"\$\((\w+)\)", a):
                    assert var in names, f"{w['metadata']['name']}/{c['name']}: $({var}) undefined"
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in docs if d["kind"] in WORKLOADS]
    for svc in _by_kind(docs, "Service"):
        sel = svc["spec"]["selector"].items()
        assert any(sel <= labels.items() for labels in pod_labels), svc["metadata"]["name"]


def test_k8s_agent_daemonset(rendered):
    variant, docs = rendered
    ds = _one(docs, "DaemonSet", "relayout-agent")
    spec = ds["spec"]["template"]["spec"]
    agent = next(c for c in spec["containers"] if c["name"] == "agent")
    cmd = agent["command"] + agent["args"]
    assert "relayout" in cmd and cmd[cmd.index("relayout") + 1] == "agent"
    for flag in ("--host", "--port", "--data-dir"):
        assert flag in cmd
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    # data dir: hostPath mounted where --data-dir points
    data_vol = next(v for v in spec["volumes"] if "hostPath" in v)
    assert data_vol["hostPath"]["path"] == DATA_DIR
    assert any(m["name"] == data_vol["name"] and m["mountPath"] == DATA_DIR for m in agent["volumeMounts"])
    cm = _one(docs, "ConfigMap", "relayout-config")["data"]
    assert cm["RELAYOUT_DATA_DIR"] == DATA_DIR
    # token from the Secret, as RELAYOUT_TOKEN
    env = {e["name"]: e for e in agent["env"]}
    assert env["RELAYOUT_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "relayout-token"
    # probes on /healthz (no token needed there)
    for probe in ("livenessProbe", "readinessProbe"):
        assert agent[probe]["httpGet"]["path"] == "/healthz"
        assert str(agent[probe]["httpGet"]["port"]) == cm["RELAYOUT_PORT"]
    # drain on the way out, with time to do it
    pre = " ".join(agent["lifecycle"]["preStop"]["exec"]["command"])
    assert "relayout drain" in pre
    assert spec["terminationGracePeriodSeconds"] >= 600
    # GPUs in the base, none in the cpu overlay
    res = agent["resources"]
    if variant == "base":
        assert int(res["limits"]["nvidia.com/gpu"]) >= 1
        assert ds["spec"]["template"]["spec"]["containers"][0]["image"].endswith("-cuda")
    else:
        assert "nvidia.com/gpu" not in res.get("limits", {}) and "nvidia.com/gpu" not in res.get("requests", {})
        assert "nodeSelector" not in spec
        assert agent["image"].endswith("-cpu")


def test_k8s_security(rendered):
    _, docs = rendered
    for w in (d for d in docs if d["kind"] in WORKLOADS):
        spec = w["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] != 0
        for c in _pod_containers(w):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False
            assert sc.get("privileged", False) is False
            assert "ALL" in sc["capabilities"]["drop"]
            if c in spec["containers"]:  # only the agent's preflight init container runs as root
                assert sc.get("runAsUser", 10001) != 0 and sc.get("runAsNonRoot", True) is True
        # only the controller talks to the API server
        if w["metadata"]["name"] != "relayout-controller":
            assert spec.get("automountServiceAccountToken") is False
    # RBAC: read-only discovery of pods and nodes, nothing else
    for role in _by_kind(docs, "Role") + _by_kind(docs, "ClusterRole"):
        for rule in role["rules"]:
            assert set(rule["verbs"]) <= {"get", "list", "watch"}, rule
            assert set(rule["resources"]) <= {"pods", "nodes"}, rule
            assert rule["apiGroups"] == [""]
    bound = {b["roleRef"]["name"] for b in _by_kind(docs, "RoleBinding") + _by_kind(docs, "ClusterRoleBinding")}
    assert bound == {r["metadata"]["name"] for r in _by_kind(docs, "Role") + _by_kind(docs, "ClusterRole")}
    for b in _by_kind(docs, "RoleBinding") + _by_kind(docs, "ClusterRoleBinding"):
        assert [s["name"] for s in b["subjects"]] == ["relayout-controller"]


def test_k8s_controller_and_gateway(rendered):
    _, docs = rendered
    ctl = _one(docs, "Deployment", "relayout-controller")
    c = ctl["spec"]["template"]["spec"]["containers"][0]
    cmd = c["command"] + c["args"]
    assert cmd[cmd.index("relayout") + 1] == "controller" and "--agents" in cmd
    assert ctl["spec"]["replicas"] == 1 and ctl["spec"]["strategy"]["type"] == "Recreate"
    gw = _one(docs, "Deployment", "relayout-gateway")["spec"]["template"]["spec"]["containers"][0]
    cmd = gw["command"] + gw["args"]
    assert cmd[cmd.index("relayout") + 1] == "gateway" and "--agent" in cmd
    svc = _one(docs, "Service", "relayout-gateway")
    assert svc["spec"]["ports"][0]["targetPort"] == gw["ports"][0]["containerPort"]
    assert _one(docs, "Service", "relayout-agent")["spec"]["clusterIP"] == "None"


def test_k8s_topology_example_parses():
    """The ConfigMap's topology.yaml is a valid fleet topology (when the planner's model is present)."""
    topology = pytest.importorskip("relayout.migrate.placement.topology")
    cm = _one(render(K8S_BASE), "ConfigMap", "relayout-config")
    topo = topology.Topology.from_dict(yaml.safe_load(cm["data"]["topology.yaml"]))
    assert len(topo.devices()) == 16


def test_k8s_secret_placeholder_is_refused_by_preflight():
    docs = render(K8S_BASE)
    token = _one(docs, "Secret", "relayout-token")["stringData"]["token"]
    ds = _one(docs, "DaemonSet", "relayout-agent")
    pre = next(c for c in ds["spec"]["template"]["spec"]["initContainers"] if c["name"] == "preflight")
    script = pre["command"][-1]
    prefix = re.search(r'\|(\w[\w-]*)\*\)', script).group(1)
    assert token.startswith(prefix)


# ---- systemd ---------------------------------------------------------------------------------------------
def parse_unit(path: Path) -> dict[str, dict[str, list[str]]]:
    """systemd unit syntax: sections, repeatable keys, comments, backslash continuations."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    text = re.sub(r"\\\n", " ", path.read_text())
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            assert line.endswith("]"), f"{path.name}:{n}: bad section header"
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"{path.name}:{n}: key outside a section"
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{n}: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def _seconds(v: str) -> float:
    units = {"": 1, "s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "ms": 0.001}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", v):
        total += float(num) * units[unit]
    return total


def _env_file_keys() -> set[str]:
    keys = set()
    for line in (SYSTEMD / "relayout.env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keys.add(line.split("=", 1)[0])
    return keys


UNITS = {"relayout-agent.service": "agent", "relayout-gateway.service": "gateway"}


@pytest.mark.parametrize("unit", sorted(UNITS))
def test_systemd_unit_structure(unit):
    u = parse_unit(SYSTEMD / unit)
    assert {"Unit", "Service", "Install"} <= set(u)
    s = {k: v[-1] for k, v in u["Service"].items()}
    argv = shlex.split(s["ExecStart"])
    assert argv[0].startswith("/") and argv[0].endswith("/relayout") and argv[1] == UNITS[unit]
    assert s["User"] not in ("root", "0")
    assert s["KillSignal"] == "SIGTERM"
    assert s["NoNewPrivileges"] == "yes" and s["ProtectSystem"] == "strict"
    for k in ("ProtectHome", "PrivateTmp", "ProtectKernelModules", "ProtectControlGroups", "RestrictSUIDSGID"):
        assert s[k] == "yes", k
    assert s["CapabilityBoundingSet"] == ""
    assert u["Install"]["WantedBy"] == ["multi-user.target"]
    # every ${VAR} / $VAR used in Exec lines comes from the EnvironmentFile example
    env_keys = _env_file_keys()
    assert s["EnvironmentFile"].lstrip("-") == "/etc/relayout/relayout.env"
    for key in ("ExecStart", "ExecStop"):
        for line in u["Service"].get(key, []):
            for var in re.findall(r"\$\{?(\w+)\}?", line):
                assert var in env_keys, f"{unit}: {key} uses ${var}, not in relayout.env.example"
    if UNITS[unit] == "agent":
        assert argv[argv.index("--data-dir") + 1] == DATA_DIR
        assert DATA_DIR in s["ReadWritePaths"].split()
        assert "relayout drain" in " ".join(u["Service"]["ExecStop"])
        assert _seconds(s["TimeoutStopSec"]) >= 600
        assert "PrivateDevices" not in s  # the replicas need /dev/nvidia*


def test_systemd_analyze_verify(tmp_path):
    tool = shutil.which("systemd-analyze")
    if not tool:
        pytest.skip("systemd-analyze not installed; structural check only")
    true = shutil.which("true")
    for unit in UNITS:
        # the relayout binary is not installed here: point Exec* at an executable that is
        text = (SYSTEMD / unit).read_text().replace("/opt/relayout/bin/relayout", true)
        (tmp_path / unit).write_text(text)
    proc = subprocess.run([tool, "verify", *(str(tmp_path / u) for u in UNITS)],
                          capture_output=True, text=True, timeout=60)
    # verify exits 0 even on unknown keys or bad values: any diagnostic about our units is a failure
    # (lines about the host's own systemd setup, e.g. in containers, are not ours to judge)
    diag = [ln for ln in (proc.stdout + proc.stderr).splitlines() if any(u in ln for u in UNITS)]
    assert proc.returncode == 0 and not diag, "\n".join(diag)


# ---- Docker ----------------------------------------------------------------------------------------------
def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instr, _, rest = line.partition(" ")
            out.append((instr.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("flavour", ["cpu", "cuda"])
def test_dockerfile_structure(flavour):
    path = DOCKER / f"Dockerfile.{flavour}"
    instrs = parse_dockerfile(path)
    froms = [rest for i, rest in instrs if i == "FROM"]
    assert len(froms) >= 2, "multi-stage build expected"
    assert instrs[0][0] in ("ARG", "FROM")
    # the final stage: runs as a non-root user, has a healthcheck on /healthz, entrypoint `relayout agent`
    last_from = max(n for n, (i, _) in enumerate(instrs) if i == "FROM")
    final = instrs[last_from:]
    users = [rest for i, rest in final if i == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = [rest for i, rest in final if i == "HEALTHCHECK"]
    assert len(health) == 1 and "/healthz" in health[0] and "CMD" in health[0]
    entry = [rest for i, rest in final if i == "ENTRYPOINT"]
    assert entry and '"relayout", "agent"' in entry[-1]
    assert any(i == "COPY" and "--from=" in rest for i, rest in final), "runtime stage copies from build"
    text = path.read_text()
    assert not re.search(r"(curl|wget)[^\n|]*\|\s*(ba|z)?sh", text), "no curl | sh"
    assert not re.search(r"^\s*ADD\s+https?://", text, re.M), "no remote ADD"
    if flavour == "cuda":
        assert "nvidia/cuda" in text and re.search(r"whl/cu\d+", text)
    else:
        assert "whl/cpu" in text
    assert "torch==" in text
    assert (DOCKER / f"Dockerfile.{flavour}.dockerignore").is_file()


def test_deploy_readmes_exist():
    assert "relayout drain" in (DEPLOY / "README.md").read_text()
    assert "docker build" in (DOCKER / "README.md").read_text()
