"""Readers for the files under deploy/: YAML documents, PromQL metric names, sizes, the Dockerfile.

They know the file formats and nothing about what the files should say (the tests do).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose"
K8S = DEPLOY / "k8s"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvstore.json"
RULES = COMPOSE / "rules.yml"


def yaml_documents(path: Path) -> list:
    """Every non-empty document of a (multi-document) YAML file."""
    with open(path, encoding="utf-8") as f:
        return [doc for doc in yaml.safe_load_all(f) if doc is not None]


def yaml_document(path: Path):
    docs = yaml_documents(path)
    assert len(docs) == 1, f"{path}: expected one YAML document, found {len(docs)}"
    return docs[0]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


# --- PromQL -------------------------------------------------------------------------------------

_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
             "offset", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (functions, keywords and labels excluded).

    Strings, label matchers ``{...}``, ranges ``[...]``, grouping label lists and Grafana
    variables are removed first; what remains are identifiers, and those not followed by ``(``
    (a function or an aggregation) are metric names.
    """
    expr = _STRING.sub('""', expr)
    expr = _GRAFANA_VARIABLE.sub("", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = _GROUPING.sub(" ", expr)
    return {m.group(1) for m in _IDENTIFIER.finditer(expr)
            if not m.group(2) and m.group(1).lower() not in _KEYWORDS}


def rule_entries(groups: list[dict]) -> list[dict]:
    return [rule for group in groups for rule in group["rules"]]


def recorded_names(groups: list[dict]) -> set[str]:
    return {rule["record"] for rule in rule_entries(groups) if "record" in rule}


def exported_sample_names(metric_names_: tuple[str, ...], histograms: set[str]) -> set[str]:
    """The sample names Prometheus stores: a histogram family as its _bucket, _sum and _count."""
    names = set()
    for name in metric_names_:
        if name in histograms:
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)
    return names


# --- sizes --------------------------------------------------------------------------------------

_K8S_UNITS = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
              "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def k8s_quantity_bytes(text: str) -> int:
    match = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert match, f"not a byte quantity: {text!r}"
    return int(match.group(1)) * _K8S_UNITS[match.group(2) or ""]


def docker_bytes(text: str) -> int:
    """A Docker/compose byte value ("5gb", "512m"): units are powers of 1024."""
    match = re.fullmatch(r"(\d+)\s*([kmgt]?)(?:i?b)?", str(text).lower())
    assert match, f"not a Docker byte value: {text!r}"
    return int(match.group(1)) * 1024 ** " kmgt".index(match.group(2) or " ")


def shm_segment_bytes(env: dict[str, str]) -> int:
    """Bytes the sidecar maps in /dev/shm with this environment: the host tier and the put staging
    area (auto: at most its default)."""
    from kvstore.config import parse_size
    from kvstore.service.staging import DEFAULT_STAGING_BYTES, STAGING_AUTO

    staging = env.get("KVSTORE_STAGING_BYTES", STAGING_AUTO)
    staging_bytes = DEFAULT_STAGING_BYTES if staging == STAGING_AUTO else parse_size(staging)
    return parse_size(env["KVSTORE_HOST_CAPACITY"]) + staging_bytes


def port_of(address: str) -> int:
    """The port of a ``HOST:PORT`` address."""
    return int(address.rsplit(":", 1)[1])


# --- Dockerfile ---------------------------------------------------------------------------------

@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (KEYWORD, arguments)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def dockerfile_stages(path: Path) -> list[Stage]:
    """The build stages, with continuation lines joined, comments dropped and global ARGs resolved."""
    lines, pending = [], ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        if raw.lstrip().startswith("#"):
            continue
        if raw.endswith("\\"):
            pending += raw[:-1] + " "
            continue
        if (pending + raw).strip():
            lines.append((pending + raw).strip())
        pending = ""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in lines:
        keyword, _, args = line.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "ARG" and not stages:
            key, _, default = args.partition("=")
            global_args[key] = default
        elif keyword == "FROM":
            words = args.split()
            base = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: global_args[m.group(1) or m.group(2)], words[0])
            stages.append(Stage(base, words[2] if len(words) > 2 and words[1].upper() == "AS" else None))
        else:
            stages[-1].instructions.append((keyword, args))
    return stages


def env_pairs(stage: Stage) -> dict[str, str]:
    """The stage's ENV settings (``KEY=VALUE`` form)."""
    pairs = {}
    for args in stage.all("ENV"):
        for word in shlex.split(args):
            key, _, value = word.partition("=")
            pairs[key] = value
    return pairs


def json_form(args: str) -> list[str]:
    """The exec (JSON) form of CMD/ENTRYPOINT/RUN; fails on the shell form."""
    value = json.loads(args)
    assert isinstance(value, list), f"expected the JSON exec form, got {args!r}"
    return value
