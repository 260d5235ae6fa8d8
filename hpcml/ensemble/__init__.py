"""Parsl glue: parameter designs, site configs, and the Campaign that runs MPI simulations
alongside an MPI training job, with retries and provenance. Imports no torch and no
particular simulation."""

from hpcml.ensemble.campaign import Campaign, CampaignResult, SimSpec, TrainingJob
from hpcml.ensemble.design import design, grid, latin_hypercube, sobol
from hpcml.ensemble.site import SiteHardware, list_sites, load_site

__all__ = ["Campaign", "CampaignResult", "SimSpec", "SiteHardware", "TrainingJob", "design", "grid",
           "latin_hypercube", "list_sites", "load_site", "sobol"]
