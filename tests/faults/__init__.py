"""The long fault stream (``stream``): a seeded stream of uploads, overwrites and deletes against the real
app with RabbitMQ restarts and consumer kills, over ``infra.harness.faults``. ``python -m tests.faults.stream``
runs it on its own."""
