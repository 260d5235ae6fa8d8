"""Write the job scripts of every docs/sites/<site>.md from the code, so the docs never drift.

    python scripts/site_docs.py          # rewrite the generated section of each page
    python scripts/site_docs.py --check  # exit 1 naming the stale pages (a unit test runs this)

The section between ``<!-- hpcml-job:begin -->`` and ``<!-- hpcml-job:end -->`` of each batch
site's page holds, for that site: the one-allocation campaign job, the pilot campaign (the
command on a login node, the trainer's allocation, the block Parsl submits) and a training
job that survives the walltime and a lost node. docs/jobs.md's section between
``<!-- hpcml-campaign-jobs:begin -->`` and its end marker holds what a campaign submits on
each site (``hpcml job --campaign-jobs``).
"""

from __future__ import annotations

import argparse
import re
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
        out += ["| queue | kind | nodes | walltime | per user: running / queued | self-requeue | picked | note "
                "| source |",
                "|---|---|---|---|---|---|---|---|---|"]
        for q in site.queues:
            nodes = f"{q.min_nodes}-{q.max_nodes}" if q.max_nodes else f"{q.min_nodes}+"
            time = f"{q.min_walltime}-{q.max_walltime}" if q.min_walltime_s else f"<= {q.max_walltime}"
            per = f"{q.max_running or '-'} / {q.max_queued or '-'}"
            out.append(f"| `{q.name}` | {q.kind} | {nodes} | {time} | {per} | "
                       f"{'yes' if q.requeue else '**no**'} | {'auto' if q.auto else '`--queue` only'} | "
                       f"{_cell(q.note) or '-'} | {_src(q.source)} |")
        out += ["", "`hpcml job` takes the first `auto` row that holds the nodes and the walltime; a `--queue` is "
                "checked against its rows; nothing fits: a one-line error with the limits.", ""]
    rows = [(f"`{m.text}`", m.why + (f"; **unverified** at the facility's pages, tried with a warning -- check: "
                                     f"{m.unverified}" if m.unverified else ""), m.source) for m in site.modules]
    rows += [(f"`{v.name}={v.value}`", v.why + ("; training only: MPI simulations run without it (`env -u`)"
                                                if v.training_only else ""), v.source) for v in site.environment]
    rows += [(f"`{d.text}`", d.why, d.source) for d in site.job_directives]
    if rows:
        out += ["| line | why | source |", "|---|---|---|"]
        out += [f"| {_cell(a)} | {_cell(b)} | {_src(c)} |" for a, b, c in rows]
    return "\n".join(out).rstrip()


CJ_BEGIN, CJ_END = "<!-- hpcml-campaign-jobs:begin -->", "<!-- hpcml-campaign-jobs:end -->"
CAMPAIGNS = ((2, "02:00:00"), (64, "06:00:00"))


def campaign_jobs_section() -> str:
    """Per batch site, what a 2-node/2-hour and a 64-node/6-hour campaign (1 trainer node) submits."""
    from hpcml.ensemble import campaign_jobs, list_sites, load_site
    from hpcml.errors import ConfigError

    out = [CJ_BEGIN, "", "| site | campaign | mode | jobs (role: queue, nodes) | at once: running / queued | why |",
           "|---|---|---|---|---|---|"]
    for name in list_sites():
        site = load_site(name)
        if site.scheduler == "local":
            continue
        for nodes, walltime in CAMPAIGNS:
            what = f"{nodes} nodes x {walltime[:2].lstrip('0')} h"
            try:
                got = campaign_jobs.plan(site, nodes=nodes, walltime=walltime)
            except ConfigError as e:
                why = str(e).split("one-allocation: ", 1)[-1].split(";")[0]  # the one job's reason says it all
                out.append(f"| `{name}` | {what} | **none fits** (exit 2) | - | - | {_cell(why)} |")
                continue
            jobs = ", ".join(f"{j.role}: `{j.queue}` {j.nodes}" for j in got.jobs)
            out.append(f"| `{name}` | {what} | {got.mode} | {jobs} | {got.max_running_at_once} / "
                       f"{got.max_queued_at_once} | {_cell(got.why)} |")
    return "\n".join(out + ["", CJ_END])


def update_jobs_page(check: bool) -> bool:
    page = ROOT / "docs" / "jobs.md"
    text = page.read_text()
    head, rest = text.split(CJ_BEGIN, 1)
    new = head + campaign_jobs_section() + rest.split(CJ_END, 1)[1]
    if new == text:
        return True
    if not check:
        page.write_text(new)
    return False


def _module_lines(site) -> set[str]:
    return {ln.strip() for f in site.modules for ln in f.text.splitlines() if ln.strip()}


def _check_modules(site, text: str, where: str) -> list[str]:
    """Every ``module load`` a page tells the user to run for ``site`` is one the site's jobs run."""
    out = []
    known = _module_lines(site)
    for line in text.splitlines():
        for part in line.split("#", 1)[0].split(";"):
            part = " ".join(part.split())
            if part.startswith("module load ") and part not in known:
                out.append(f"{where}: `{part}` is not a module line of site {site.name} ({sorted(known)})")
    return out


def prose_problems(name: str, text: str) -> list[str]:
    """What a site page states by hand, outside its generated section, checked against the
    site's data: the simulations' prefix, the training launch line, the modules, the GPU
    binding and the queues picked by default. A statement the code no longer makes fails."""
    from hpcml.ensemble import load_site

    site = load_site(name)
    outside = text.split(BEGIN, 1)[0] + (text.split(END, 1)[1] if END in text else "")
    where = f"docs/sites/{name}.md"
    out = []
    for m in re.finditer(r'`site\.sim_prefix\(R\) == f?"([^"]*)"`', outside):
        claimed = re.sub(r"\bR\b", "7", m[1].replace("{R}", "7"))
        if claimed != site.sim_prefix(7):
            out.append(f"{where}: says site.sim_prefix(R) == {m[1]!r}; the site's is {site.sim_prefix(7)!r} (R=7)")
    launch = site.train_line(["python", "workflows/llm_pretrain.py", "..."], nodes=2)
    for line in outside.splitlines():
        if re.match(r"(srun|mpiexec|jsrun) .*python workflows/llm_pretrain\.py \.\.\.$", line) and line != launch:
            out.append(f"{where}: training launch {line!r}; the site's is {launch!r}")
    out += _check_modules(site, outside, where)
    if "HPCML_GPU_MAP" in site.env and re.search(r"local_rank % \d", outside):
        out.append(f"{where}: says ranks bind `local_rank % N`; the site binds HPCML_GPU_MAP="
                   f"{site.env['HPCML_GPU_MAP']}")
    m = re.search(r"Default queue[^.]*\.", outside, re.S)
    if m and site.queues:
        auto = list(dict.fromkeys(q.name for q in site.queues if q.auto))
        named = re.findall(r"`([\w.-]+)`", m[0])
        missing = [q for q in auto if q not in named]
        wrong = [q for q in named if q not in {r.name for r in site.queues} or q in
                 {r.name for r in site.queues if not r.auto} - set(auto)]
        if missing or wrong:
            out.append(f"{where}: the default-queue sentence names {named}; the site picks from {auto}")
    return out


def install_problems() -> list[str]:
    """docs/install.md's module lines, per site section, against the site's modules."""
    from hpcml.ensemble import list_sites, load_site

    text = (ROOT / "docs" / "install.md").read_text()
    out = []
    for m in re.finditer(r"^### (\w+) \(.*?(?=^### |\Z)", text, re.S | re.M):
        name = m[1].lower()
        if name in list_sites():
            out += _check_modules(load_site(name), m[0], f"docs/install.md ({m[1]})")
    return out


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
    if not update_jobs_page(args.check):
        stale.append("jobs.md (campaign jobs)")
    prose = [p for n in list_sites() if load_site(n).scheduler != "local"
             for p in prose_problems(n, (ROOT / "docs" / "sites" / f"{n}.md").read_text())] + install_problems()
    for p in prose:
        print(f"stale statement: {p}", file=sys.stderr)
    if prose:
        return 1
    if stale and args.check:
        print(f"stale job scripts in docs/sites: {', '.join(stale)} (run python scripts/site_docs.py)",
              file=sys.stderr)
        return 1
    if stale:
        print(f"updated docs/sites: {', '.join(stale)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
