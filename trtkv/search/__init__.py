"""Tree search (ToT) over trtkv's forking paged cache: ``trtkv search`` and ``Engine.search``."""
from trtkv.search.config import SearchConfig
from trtkv.search.driver import run_search
from trtkv.search.tasks import SEARCH_TASKS, SearchProblem, get_task

__all__ = ["SearchConfig", "SearchProblem", "SEARCH_TASKS", "get_task", "run_search"]
