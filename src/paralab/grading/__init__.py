"""``paralab grade``: a course's autograder (``commands/grade.py``).

``assignment.py`` reads what a submission must be and what each test is worth; ``sandbox.py`` runs one
untrusted command inside bubblewrap with limits; ``grade.py`` runs a submission's checks there and scores
each test from the runs' records. docs/grading.md is the course staff's page.
"""
