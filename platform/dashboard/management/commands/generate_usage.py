"""python manage.py generate_usage [--days 30] [--users 12] [--requests-per-day 2000] [--seed 0] [--batches 10]"""

from django.core.management.base import BaseCommand

from dashboard import services, synthetic


class Command(BaseCommand):
    help = "Generate realistic synthetic usage (demo users, API keys, models, sources, latencies) and roll it up."

    def add_arguments(self, parser):
        parser.add_argument("--days", type=int, default=30)
        parser.add_argument("--users", type=int, default=12)
        parser.add_argument("--requests-per-day", type=int, default=2000)
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--batches", type=int, default=0, help="also create this many demo batch jobs")
        parser.add_argument("--no-rollup", action="store_true", help="leave the roll-up to the periodic task")

    def handle(self, *args, days, users, requests_per_day, seed, batches, no_rollup, **options):
        def progress(done, hours, rows):
            self.stdout.write(f"\r  hour {done}/{hours}: {rows} usage rows", ending="")
            self.stdout.flush()

        self.stdout.write(f"Generating {days} days of usage for {users} demo users (seed {seed})")
        rows = synthetic.generate(
            days=days, users=users, requests_per_day=requests_per_day, seed=seed, progress=progress
        )
        self.stdout.write("")
        if batches:
            synthetic.generate_batches(count=batches, seed=seed)
            self.stdout.write(f"Created {batches} demo batch jobs")
        if not no_rollup:
            done = services.roll_up_usage()
            self.stdout.write(f"Rolled up {done['hours']} hours into {done['rows']} hourly rows")
        self.stdout.write(self.style.SUCCESS(f"Created {rows} usage rows"))
