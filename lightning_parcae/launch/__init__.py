"""Launch: starting and keeping a job's processes -- ``parcae run`` (one machine), ``parcae agent`` (one per machine)
and the ``parcae`` command line.

Problem: workers come and go with the instances under them. Something outside the workers must host (or find) the
job's store, start the training script on each instance, deliver notices, restart released or fenced workers as
warm standbys and relaunch from the checkpoint when a whole stage is lost. This is the top of the flow: it may
import every other layer, and nothing imports it.
"""
