"""One index job: the consumer's task, the state machine over the catalog, the stages it runs, and
the task queue that carries it."""
