"""The public Generate API, the batcher, the HRM planner and the CGOPipe driver."""
