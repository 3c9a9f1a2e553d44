"""What the service keeps: uploads, files, jobs, responses, inferlet components, and the index
they share (SQLite by default, PostgreSQL across replicas)."""
