"""Parsl glue: parameter designs, typed sites, batch job scripts, the Parsl apps of a
campaign and the Campaign that runs MPI simulations alongside an MPI training job, with
retries, provenance, the walltime and requeue; searches whose trials are training jobs
(``Search``: grid, random, ASHA). Imports no torch and no particular simulation."""

from hpcml.ensemble.campaign import Campaign
from hpcml.ensemble.design import design, full_factorial, latin_hypercube, sobol
from hpcml.ensemble.hardware import SiteHardware
from hpcml.ensemble.members import Members
from hpcml.ensemble.breed import Breed
from hpcml.ensemble.sampling import FullFactorial, Halton, LatinHypercube, Sampler, SimStats
from hpcml.ensemble.site import Site, list_sites, load_site
from hpcml.ensemble.run_report import workflow_summary
from hpcml.ensemble.asha import SearchConfig
from hpcml.ensemble.search import Search, SearchError, SearchInterrupted, SearchResult
from hpcml.ensemble.spec import CampaignResult, SimSpec, TrainingJob

__all__ = ["Breed", "Campaign", "CampaignResult", "FullFactorial", "Halton", "LatinHypercube", "Members", "Sampler",
           "Search", "SearchConfig", "SearchError", "SearchInterrupted", "SearchResult", "SimSpec", "SimStats", "Site",
           "SiteHardware", "TrainingJob", "design", "full_factorial", "latin_hypercube", "list_sites", "load_site",
           "sobol", "workflow_summary"]
