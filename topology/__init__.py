"""Topologies: which actor runs where, and the typed configuration every actor gets.

The package sits beside its YAML files (topology/*.yaml) and below actors/ in the import direction
(tools -> actors -> (topology, transport, algo)): actors take their typed settings from it, and it never imports
actors/ or tools/ (it finds an actor class's settings model through the class itself).

* topology.section: the base of every configuration model, and the one-line problem reports naming each
  key's path.
* topology.experiment: the experiment config's models (configs/*.yaml).
* topology.settings: what every actor receives (``actor.cfg``), per actor class.
* topology.schema: the topology file's models.
* topology.placement: checks across sections, and the placement of instances onto nodes, GPUs, cores, ports.
* topology.loading: YAML, experiment config, `key.sub=value` overrides, and the resolved configuration with
  where each value came from.
"""
from topology.loading import (apply_overrides, load, load_document, load_experiment, parse_override,
                              resolved_config, show_config)
from topology.placement import (REPO_ROOT, GroupSpec, Instance, LinkPlan, LinkSpec, NodeSpec, Plan, Topology,
                                TopologyError, expand_nodelist, place, resolve_host, validate)

__all__ = ["TopologyError", "Topology", "NodeSpec", "LinkSpec", "GroupSpec", "Instance", "LinkPlan", "Plan",
           "REPO_ROOT", "load", "load_document", "load_experiment", "parse_override", "apply_overrides", "validate", "place",
           "expand_nodelist", "resolve_host", "resolved_config", "show_config"]
