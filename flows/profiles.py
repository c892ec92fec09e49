"""Shape profiles from traffic, on their own: propose min/opt/max from the shapes a service sees.

    python -m flows.profiles [--config-dir DIR] model=NAME traffic.source=PATH [traffic.profiles=K]
        [traffic.coverage=0.999] [traffic.max_activation_mib=N] [profiles_out=PATH] [--write]

Prints the proposal (profiles, requests each covers, outliers, the objective per number of profiles and why this
one) and the YAML fragment to paste into the model's YAML; ``profiles_out`` writes it as JSON; ``--write`` replaces
the ``profiles:`` of the model YAML (in the config dir, else conf/model/NAME.yaml). Exit 2 on bad input.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.config import compose_config, config_dir_search, model_io
from tasks.common import ConfigError, TrtforgeError
from tasks.common import write_json
from flows.local.private import for_user  # (results follow the user's umask)

CONF = Path(__file__).resolve().parent.parent / "conf"


def model_yaml(name: str, config_dir: str | None) -> Path:
    for d in ([Path(config_dir).expanduser()] if config_dir else []) + [CONF]:
        p = d / "model" / f"{name}.yaml"
        if p.is_file():
            return p
    raise ConfigError(f"no model YAML for model={name}", fix="give --config-dir with model/NAME.yaml")


def propose_for(overrides: list[str], config_dir: str | None = None):
    """(cfg, Traffic, Proposal) for the overrides: ``traffic.*`` are the model's ``model.traffic.*``."""
    from omegaconf import OmegaConf

    from tasks.data import check_multiples, graph_ties, named_ties
    from tasks.data import from_config

    cfg = compose_config([f"model.{o}" if o.startswith("traffic.") else o for o in overrides], config_dir)
    if not cfg.model.traffic.source:
        raise ConfigError("model.traffic.source is not set", fix="give traffic.source=path/to/requests.jsonl")
    from flows.config import bind_constants

    search = config_dir_search(config_dir)
    model, inputs, _, _ = model_io(cfg, search)
    inputs = bind_constants(cfg, inputs)
    given = check_multiples(OmegaConf.to_container(cfg.model.shape_multiple), inputs)
    ties = named_ties(inputs) + (graph_ties(model, inputs) if model is not None else [])
    traffic, proposal = from_config(OmegaConf.to_container(cfg.model.traffic), inputs, model, [], given, ties, search)
    return cfg, traffic, proposal


def main(argv: list[str] | None = None) -> int:
    from tasks.data import describe, write_profiles, yaml_fragment

    ap = argparse.ArgumentParser(prog="python -m flows.profiles", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config-dir", help="a folder of config groups (model/NAME.yaml ...) that adds to conf/")
    ap.add_argument("--write", action="store_true", help="put the profiles into the model YAML")
    ap.add_argument("overrides", nargs="*", help="model=NAME traffic.source=PATH [profiles_out=PATH] ...")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    out = next((o.split("=", 1)[1] for o in args.overrides if o.startswith("profiles_out=")), None)
    overrides = [o for o in args.overrides if not o.startswith("profiles_out=")]
    try:
        cfg, traffic, proposal = propose_for(overrides, args.config_dir)
        print(f"{cfg.model.name}: traffic {traffic.source}")
        print(describe(proposal))
        print("\n# for the model YAML:\n" + yaml_fragment(proposal.profiles), end="")
        if out:
            for_user(write_json(Path(out), {"requests": proposal.requests, "coverage": proposal.coverage,
                                   "profiles": proposal.profiles, "outliers": proposal.outliers,
                                   "per_profile": proposal.per_profile, "k_reason": proposal.k_reason,
                                   "objective": {str(k): v for k, v in proposal.objective.items()}}))
            print(f"wrote {out}")
        if args.write:
            path = model_yaml(cfg.model.name, args.config_dir)
            write_profiles(path, proposal.profiles)
            print(f"wrote the profiles into {path}")
        return 0
    except TrtforgeError as e:
        if os.environ.get("TRTFORGE_TRACEBACK"):
            raise
        print(f"trtforge: error: {e.render()}", file=sys.stderr)
        return e.exit_code if e.exit_code != 1 else 2


if __name__ == "__main__":
    sys.exit(main())
