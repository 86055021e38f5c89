"""Running one job: the consumer's task, the job kinds (frames, words) and the stages they run. How a
job is submitted and how a row changes is ``pipeline.jobs``."""
