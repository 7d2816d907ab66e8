"""The front end: annotate, argument checks, capture and profile, the warm-up memory trace.
Imports the data model, the hardware, the models and the passes; nothing above."""
