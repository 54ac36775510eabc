"""The run's roles as Ray actors: env workers, rollout (inference) workers, actor (learner)
workers, placed by a validated ``cluster:`` config block (embodied/cluster/config.py).

Importing this package does not import Ray: the embedded default never does.
"""

from __future__ import annotations


def ray_roles(cfg, resume: dict | None, run_dir, **kw):
    """``RayRoles`` for ``cfg`` (see embodied/cluster/roles.py); Ray is imported here."""
    from embodied.cluster.roles import RayRoles

    return RayRoles(cfg, resume, run_dir, **kw)
