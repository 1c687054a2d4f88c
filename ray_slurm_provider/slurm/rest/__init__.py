"""The slurmrestd transport: `client.py` (the SlurmClient), `http.py` (requests and error
classification), `job.py` (JobSpec -> job description), `parse.py` (responses -> Job)."""
