"""The words in a video: subtitle tracks, on-screen text (OCR) and speech (ASR), each as timed
``TextSegment``s on the player's timeline, the one frames use (``pipeline.media.probe.timeline_zero``)."""
