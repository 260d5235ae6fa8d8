"""Write the job scripts of every docs/sites/<site>.md from the code, so the docs never drift.

    python scripts/site_docs.py          # rewrite the generated section of each page
    python scripts/site_docs.py --check  # exit 1 naming the stale pages (a unit test runs this)

The section between ``<!-- hpcml-job:begin -->`` and ``<!-- hpcml-job:end -->`` of each batch
site's page holds, for that site: the one-allocation campaign job, the pilot campaign (the
command on a login node, the trainer's allocation, the block Parsl submits) and a training
job that survives the walltime and a lost node.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BEGIN, END = "<!-- hpcml-job:begin -->", "<!-- hpcml-job:end -->"
VENV = "/path/to/hpcml/.venv"
ACCOUNT = "PROJ123"
#: Nodes of the one-allocation campaign job (slurm-local has two).
DRIVER_NODES = {"slurm-local": 2}


def _normal(text: str) -> str:
    return text.replace(sys.prefix, VENV).rstrip("\n")


def section(name: str) -> str:
    from hpcml.ensemble import Campaign, TrainingJob, load_site
    from hpcml.ensemble.block_preview import render_batch_script
    from hpcml.ensemble.jobscript import job_spec, render

    site = load_site(name)
    slurm = site.scheduler == "slurm"
    heat = ["python", "workflows/heat_surrogate.py", "--site", name, "--train-nodes", "1", "--resume",
            "--run-dir", "runs/heat"]
    driver = render(job_spec(site=name, command=heat, nodes=DRIVER_NODES.get(name, 3), walltime="02:00:00",
                             account=ACCOUNT, driver=True,
                             name="campaign"))
    tp = str(min(site.train_ranks_per_node, 8))
    llm = ["python", "workflows/llm_pretrain.py", "--tp", tp, "--ckpt-dir", "ck", "--ckpt-every", "100",
           "--auto-resume"]
    nodes = "1-2" if slurm else "2"
    train = render(job_spec(site=name, command=llm, nodes=nodes, walltime="02:00:00", account=ACCOUNT, name="train"))
    with tempfile.TemporaryDirectory() as tmp:
        campaign = Campaign(run_dir=tmp, site=site, site_options={"walltime": "02:00:00", "account": ACCOUNT})
        trainer = campaign.train_line(TrainingJob(argv=["python", "workflows/heat_surrogate.py", "--role", "train",
                                                        "..."]), allocate=True).replace(tmp, "runs/heat")
        block = render_batch_script(site.parsl_config(run_dir=tmp, nodes=2, walltime="02:00:00", account=ACCOUNT))
    ext = {"slurm": "sbatch", "pbs": "pbs", "lsf": "lsf"}[site.scheduler]
    submit = {"slurm": "sbatch", "pbs": "qsub", "lsf": "bsub <"}[site.scheduler]
    range_note = ("`--nodes 1-2`: after a node is lost, Slurm requeues the job on the node that is left and "
                  "`llm_pretrain.py --auto-resume` continues on the layout that fits "
                  f"(`--tp {tp}` kept, dp what is left)." if slurm else
                  f"{site.scheduler.upper()} takes a fixed node count: a job that lost a node is resubmitted "
                  "(or requeued) as a whole and `--auto-resume` continues from `latest`.")
    return f"""{BEGIN}
<!-- written by scripts/site_docs.py from the code: do not edit by hand -->

{rules_section(site)}

### A campaign in one allocation (the driver inside the job)

```bash
hpcml job --site {name} --nodes 3 --walltime 02:00:00 --account {ACCOUNT} --driver --name campaign \\
    --script campaign.{ext} -- python workflows/heat_surrogate.py --site {name} --train-nodes 1 --resume \\
    --run-dir runs/heat
{submit} campaign.{ext}
```

What goes where: the driver runs in the batch shell on the job's first node and starts
Parsl's workers there (no second queue wait); the training job takes the job's first node
(`--train-nodes 1`, pinned with the launcher's host option); the simulations run on the
other two nodes. Every timeout follows from `HPCML_JOB_DEADLINE`. The walltime warning
reaches the driver as SIGUSR1: it cancels the running simulations, the trainer saves and
exits 75, and the job is requeued; the next run (`--resume`) skips the simulations that
finished and the trainer resumes from its checkpoint.

```bash
{_normal(driver)}
```

### A pilot campaign (the driver on a login node)

```bash
python workflows/heat_surrogate.py --site {name} --nodes 2 --walltime 02:00:00 --account {ACCOUNT} \\
    --run-dir runs/heat
```

Parsl submits the simulations' block (`{block.submit_command}`); the training job gets an
allocation of its own:

```bash
{trainer}
```

The block Parsl submits (workers stop taking simulations in the last tenth of the walltime):

```bash
{_normal(block.text)}
```

### A training job that survives the walltime and a lost node

```bash
hpcml job --site {name} --nodes {nodes} --walltime 02:00:00 --account {ACCOUNT} --name train \\
    --script train.{ext} -- python workflows/llm_pretrain.py --tp {tp} --ckpt-dir ck --ckpt-every 100 --auto-resume
{submit} train.{ext}
```

{range_note}

```bash
{_normal(train)}
```
{END}"""


def _src(source) -> str:
    if source is None:
        return "hpcml"
    link = source.url if source.url.startswith("http") else f"../../{source.url}"
    return f"[{source.url.split('//')[-1].rstrip('/')}]({link}) ({source.read})"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def rules_section(site) -> str:
    """The site's rules as data: queue table, account rule, modules, environment, each with its source."""
    out = ["### Rules (site_configs data, with their sources)", ""]
    if site.retired:
        out += [f"**Retired:** {site.retired}. `hpcml job` still writes its scripts, with a note.", ""]
    if site.account is not None:
        need = "required" if site.account.required else "optional"
        out += [f"Account: **{need}** -- {_cell(site.account.why)} ({_src(site.account.source)}). `hpcml job` takes "
                "`--account` or `$HPCML_ACCOUNT`.", ""]
    if site.queues:
        out += ["| queue | kind | nodes | max walltime | jobs per user | self-requeue | picked | note | source |",
                "|---|---|---|---|---|---|---|---|---|"]
        for q in site.queues:
            nodes = f"{q.min_nodes}-{q.max_nodes}" if q.max_nodes else f"{q.min_nodes}+"
            out.append(f"| `{q.name}` | {q.kind} | {nodes} | {q.max_walltime} | {q.max_jobs or '-'} | "
                       f"{'yes' if q.requeue else '**no**'} | {'auto' if q.auto else '`--queue` only'} | "
                       f"{_cell(q.note) or '-'} | {_src(q.source)} |")
        out += ["", "`hpcml job` takes the first `auto` row that holds the nodes and the walltime; a `--queue` is "
                "checked against its rows; nothing fits: a one-line error with the limits.", ""]
    rows = [(f"`{m.text}`", m.why, m.source) for m in site.modules]
    rows += [(f"`{v.name}={v.value}`", v.why, v.source) for v in site.environment]
    rows += [(f"`{d.text}`", d.why, d.source) for d in site.job_directives]
    if rows:
        out += ["| line | why | source |", "|---|---|---|"]
        out += [f"| {_cell(a)} | {_cell(b)} | {_src(c)} |" for a, b, c in rows]
    return "\n".join(out).rstrip()


def update(page: Path, name: str, check: bool) -> bool:
    """True when ``page`` was current (or is now)."""
    text = page.read_text()
    new_section = section(name)
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        new = head + new_section + rest.split(END, 1)[1]
    else:
        new = text.rstrip("\n") + "\n\n## Job scripts\n\n" + new_section + "\n"
    if new == text:
        return True
    if not check:
        page.write_text(new)
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page is stale")
    args = p.parse_args()
    from hpcml.ensemble import list_sites, load_site

    stale = [n for n in list_sites() if load_site(n).scheduler != "local"
             and not update(ROOT / "docs" / "sites" / f"{n}.md", n, args.check)]
    if stale and args.check:
        print(f"stale job scripts in docs/sites: {', '.join(stale)} (run python scripts/site_docs.py)",
              file=sys.stderr)
        return 1
    if stale:
        print(f"updated docs/sites: {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
