"""`ray-slurm schema`: the JSON Schema of a whole cluster YAML, for editors.

Ray's own schema (`ray/autoscaler/ray-schema.json` of the installed Ray, read at run time, as
`ray up` reads it) with this provider's sections put in from the config model: `provider:` and
every `available_node_types.<name>.node_config`. Point an editor at it with a first line
`# yaml-language-server: $schema=/path/to/schema.json`.
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

from ray_slurm_provider import rayapi
from ray_slurm_provider.config import NodeConfig, ProviderConfig
from ray_slurm_provider.schema import adapter

#: Draft 7 (Ray's) keeps shared definitions under `definitions`.
REF = "#/definitions/{model}"
#: Keys bootstrap writes into the provider section for the head (`_node_types`, ...).
INTERNAL = "^_"


def model_schema(cls: type[Any], definitions: dict[str, Any]) -> dict[str, Any]:
    """The JSON Schema of one model; its nested models go into `definitions`."""
    schema: dict[str, Any] = adapter(cls).json_schema(ref_template=REF)
    definitions.update(schema.pop("$defs", {}))
    return schema


def cluster_schema() -> dict[str, Any]:
    """Ray's cluster schema with the provider section and node_config from the model."""
    schema = copy.deepcopy(rayapi.config_schema())
    definitions = schema.setdefault("definitions", {})
    props = schema["properties"]
    provider = model_schema(ProviderConfig, definitions)
    provider["description"] = "The Slurm provider's cluster-wide settings."
    provider["required"] = sorted(set(props["provider"].get("required", [])))
    provider["patternProperties"] = {INTERNAL: {}}
    props["provider"] = provider
    node_type = props["available_node_types"]["patternProperties"][".*"]
    node_config = model_schema(NodeConfig, definitions)
    node_config["description"] = "The Slurm job of one node type (one job per Ray node)."
    node_type["properties"]["node_config"] = node_config
    schema["title"] = "Ray cluster config for ray-slurm-provider"
    schema.pop("$id", None)  # it names Ray's schema; this one is another
    return schema


def cmd_schema(args: argparse.Namespace) -> int:
    print(json.dumps(cluster_schema(), indent=2, sort_keys=True))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("schema", help="print the JSON Schema of a cluster YAML (for editors: "
                       "`ray-slurm schema > ~/.ray_slurm/schema.json`)")
    p.set_defaults(func=cmd_schema)
