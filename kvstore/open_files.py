"""The process's open-files limit (RLIMIT_NOFILE): raising its soft limit to the hard one.

Shells' and systemd's default soft limit is 1,024, the hard one far higher. A disk tier holds one
descriptor per segment file, and every connection to the sidecar's ports holds one. This module
knows nothing of tiers or ports: its callers say why they need descriptors.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_open_files_limit(why: str) -> None:
    """Raise this process's soft RLIMIT_NOFILE to its hard limit, logged (with ``why``) when it
    changes. Idempotent; a limit that cannot be raised is left as it is (and a warning logged)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20  # Linux's default fs.nr_open
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d (%s)", soft, target, exc)
            return
        log.info("raised the open-files limit (RLIMIT_NOFILE) from %d to %d: %s", soft, target, why)
