"""The pure core: CPU sets, topology model, planner, guest map. No I/O, no frameworks."""
