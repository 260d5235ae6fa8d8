"""What Parsl would submit for one block of a pilot campaign, without submitting it.

A dry run for the login node: the batch script the ``sims`` executor's provider writes.
(The outer job a user submits for a whole campaign or training run is
:mod:`hpcml.ensemble.jobscript`.)
"""

from __future__ import annotations

import math
import string
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hpcml.ensemble.site import SIMS_LABEL
from hpcml.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from parsl.config import Config

#: Stands for the worker-pool command in a rendered batch script: Parsl composes the real
#: one (interchange addresses, ports) only when the executor starts.
WORKER_COMMAND_PLACEHOLDER = "process_worker_pool.py <composed by Parsl at start>"


@dataclass(frozen=True, kw_only=True)
class BatchScript:
    """What a provider would submit for one block: the command and the script."""

    submit_command: str
    """e.g. ``sbatch submit_scripts/parsl.sims.block``, ``qsub -q debug -A proj ...``."""
    text: str
    """The batch script, as the provider's own template renders it."""


def render_batch_script(config: Config, *, worker_command: str = WORKER_COMMAND_PLACEHOLDER,
                        script_dir: str = "submit_scripts") -> BatchScript:
    """The batch script the ``sims`` executor's provider would submit, without submitting it.

    Fills the provider's public template (``parsl.providers.<name>.template``) with the
    values its ``submit()`` computes (Parsl 2026.10.26: Slurm, LSF and PBS Pro providers),
    as ``string.Template`` -- what Parsl itself does -- without calling a private method;
    for previews (a dry run) and tests.
    """
    from parsl.providers import LSFProvider, PBSProProvider, SlurmProvider
    from parsl.providers.lsf.template import template_string as lsf_template
    from parsl.providers.slurm.template import template_string as slurm_template
    from parsl.utils import wtime_to_minutes

    executor = next((e for e in config.executors if e.label == SIMS_LABEL), None)
    provider = getattr(executor, "provider", None)
    if not isinstance(provider, (SlurmProvider, LSFProvider, PBSProProvider)):
        raise ConfigError(f"the {SIMS_LABEL!r} executor submits no batch script "
                          f"(provider {type(provider).__name__})")
    job_name = f"parsl.{SIMS_LABEL}.block"
    script_path = f"{script_dir}/{job_name}"
    nodes = provider.nodes_per_block
    values: dict[str, Any] = {
        "submit_script_dir": script_dir, "nodes": nodes, "tasks_per_node": 1,
        "scheduler_options": provider.scheduler_options, "worker_init": provider.worker_init,
        "job_stdout_path": f"{script_path}.stdout", "job_stderr_path": f"{script_path}.stderr",
        "user_script": provider.launcher(worker_command, 1, nodes, script_dir),
    }
    if isinstance(provider, SlurmProvider):
        template, values["walltime"] = slurm_template, wtime_to_minutes(provider.walltime)
        if provider.mem_per_node is not None:
            values["scheduler_options"] += f"#SBATCH --mem={provider.mem_per_node}g\n"
            values["worker_init"] += f"export PARSL_MEMORY_GB={provider.mem_per_node}\n"
        if provider.cores_per_node is not None:  # as Parsl writes it (no newline): see Parsl #3006
            cpus_per_task = math.floor(provider.cores_per_node / 1)
            values["scheduler_options"] += f"#SBATCH --cpus-per-task={cpus_per_task}"
            values["worker_init"] += f"export PARSL_CORES={cpus_per_task}\n"
        submit = f"sbatch {script_path}"
    elif isinstance(provider, LSFProvider):
        template, values["walltime"] = lsf_template, wtime_to_minutes(provider.walltime)
        script_path += ".submit"
        submit = f"bsub {'< ' if provider.bsub_redirection else ''}{script_path}"
    else:
        template, values["walltime"] = provider.template_string, provider.walltime
        values["nodes_per_block"], values["ncpus"] = nodes, provider.cpus_per_node
        select = provider.select_options
        values["select_options"] = f":{select}" if select and not select.startswith(":") else select
        options = "".join(f" -{flag} {value}" for flag, value in (("q", provider.queue), ("A", provider.account))
                          if value is not None)
        submit = f"qsub{options} {script_path}"
    try:
        text = string.Template(template).substitute(jobname=job_name, **values)
    except (KeyError, ValueError) as e:
        raise ConfigError(f"{type(provider).__name__}'s template needs {e} (Parsl changed it: pin parsl)") from None
    return BatchScript(submit_command=submit, text=text)
