FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 MAILRELAY_DATA_DIR=/var/lib/mailrelay
WORKDIR /app
COPY pyproject.toml constraints.txt ./
COPY mailrelay ./mailrelay
COPY queues ./queues
COPY delivery ./delivery
COPY tracking ./tracking
COPY insight ./insight
# The versions we test with (constraints.txt), not whatever is newest today.
RUN pip install --no-cache-dir -c constraints.txt .
COPY . .
RUN mkdir -p /var/lib/mailrelay && python manage.py collectstatic --noinput
EXPOSE 25 8000
