"""Scale-out on Ray: engine replicas as Ray actors behind one front (the FastAPI app),
a prefix- and load-aware router, and the planning simulator that reuses the router.

`router.py` and `pools.py` know nothing of Ray, so the simulator runs the very same code.
"""
