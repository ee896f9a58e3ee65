//! `lamina`: create log-structured arrays, carve volumes, serve them over NBD.

// serde_json's json! macro nests deeply for the status document.
#![recursion_limit = "256"]

mod admin;
mod arrays;
mod bench;
mod combine;
mod config;
mod csal;
mod devices;
mod emulate;
mod fsck;
mod heap;
mod iops;
mod labels;
mod notify;
mod output;
mod qos;
mod rebuild;
mod runtime;
mod serve;
mod sim;
mod size;
mod top;

#[global_allocator]
static HEAP: heap::Counting = heap::Counting;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use config::Config;
use lamina_core::{EngineConfig, FormatParams, OpenMode, Request};
use lamina_device::file::{FileDevice, OpenMode as DevMode};
use lamina_device::BlockDevice;
use lamina_format::superblock::Layout;
use serde_json::json;
use size::{human, parse_size};
use std::path::{Path, PathBuf};
use std::sync::Arc;

const ABOUT: &str = "Log-structured block storage: arrays of cheap devices, served as NBD volumes";

const LONG_ABOUT: &str = "\
Lamina turns backing files or block devices into a log-structured ARRAY and serves
VOLUMES carved from it over the NBD protocol. Every write goes out of place into
large sequential segments, so low-endurance SSDs, SMR disks and parity arrays see
only the access pattern they handle well; garbage collection reclaims space.

An array lives in a directory DIR that holds only lamina.toml (the device paths,
sockets and tunables), the admin socket and the log. Everything else - layout,
volumes, the block map - is on the devices themselves, so they can be moved.

QUICK START
    lamina serve                 # creates ./lamina-data with one sparse file
    nbdinfo 'nbd+unix:///default?socket=lamina-data/nbd.sock'

EXIT STATUS
    0 success, 1 failure (the message says what and where), 2 bad usage.";

#[derive(Parser)]
#[command(name = "lamina", version, about = ABOUT, long_about = LONG_ABOUT)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Create arrays, fail and replace members, scrub.
    #[command(subcommand)]
    Array(ArrayCmd),
    /// Create, list, limit and delete volumes.
    #[command(subcommand)]
    Volume(VolumeCmd),
    /// Serve the volumes of an array over NBD (creates a default array if needed).
    #[command(long_about = SERVE_ABOUT)]
    Serve(serve::ServeArgs),
    /// Show capacity, space use and write amplification.
    #[command(long_about = STATUS_ABOUT)]
    Status(StatusArgs),
    /// Replay a workload or block trace through the engine, without data.
    #[command(long_about = sim::SIM_ABOUT)]
    Sim(Box<sim::SimArgs>),
    /// Sketch an SSD's geometry from the timing of I/O patterns (a device, or an
    /// emulated drive).
    #[command(long_about = PROBE_ABOUT)]
    Probe(ProbeArgs),
    /// Benchmark yardsticks and the seed papers' experiments on emulated devices
    /// (RAID-5 read-modify-write, SSD endurance, IOPS, SMR, geometry-aware placement).
    #[command(subcommand)]
    Bench(bench::BenchCmd),
    /// Check a stopped array's metadata offline (exit 0 clean, 1 repaired, 4
    /// damage left, 8 could not run).
    #[command(long_about = fsck::FSCK_ABOUT)]
    Fsck {
        dir: PathBuf,
        /// Mend what is safe: superblock copies, and blocks and parity from their rows.
        #[arg(long)]
        repair: bool,
        /// Also read every live block and verify its checksum.
        #[arg(long)]
        data: bool,
        /// The report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Serve an emulated SSD over NBD, paced to the drive's latencies.
    #[command(long_about = emulate::EMULATE_ABOUT)]
    Emulate(emulate::EmulateArgs),
    /// A live view of a running server: requests, latency, space, write
    /// amplification, members.
    #[command(long_about = top::TOP_ABOUT)]
    Top(TopArgs),
    /// Print the completion script for a shell (bash, zsh, fish, elvish, powershell).
    #[command(long_about = COMPLETIONS_ABOUT)]
    Completions {
        /// The shell to complete for.
        shell: clap_complete::Shell,
    },
    /// Write the manual pages: lamina(1) and one per command, made from this help.
    #[command(long_about = MAN_ABOUT)]
    Man {
        /// Write lamina.1, lamina-serve.1, lamina-array-create.1, ... into this
        /// directory (made if missing); without it, lamina(1) goes to standard
        /// output.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
}

#[derive(clap::Args)]
struct TopArgs {
    /// Array directory of the running server (default ./lamina-data).
    dir: Option<PathBuf>,
    /// Seconds between views (0.1 to 3600).
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    interval: f64,
    /// Stop after this many views (default: until interrupted).
    #[arg(long, value_name = "N")]
    count: Option<u64>,
}

const COMPLETIONS_ABOUT: &str = "\
Print the completion script for SHELL to standard output. Install it where the shell
looks for completions, for example:

    lamina completions bash > /etc/bash_completion.d/lamina
    lamina completions zsh > /usr/local/share/zsh/site-functions/_lamina
    lamina completions fish > ~/.config/fish/completions/lamina.fish";

const MAN_ABOUT: &str = "\
Write the manual pages, made from the same text as --help: lamina(1) and one page
per command (lamina-serve(1), lamina-array-create(1), ...). With --dir they are
written there and listed; without it, lamina(1) goes to standard output.

    lamina man --dir /usr/local/share/man/man1 && mandb
    lamina man | man -l -";

const PROBE_ABOUT: &str = "\
Run black-box I/O patterns (after the SSD sketcher of the Hystor paper) and report,
with the measurements behind each verdict: the indirection unit (random writes of
growing size: below the unit each costs a read-modify-write), the number of parallel
units (random reads at growing queue depth), whether the drive places data by write
order or by LBA (a region written in random order read back both ways), and the GC
cliff (sustained random writes); then a write unit, segment size and queue depth for
Lamina.

A real device (or file) is timed with direct I/O by the wall clock over its first
--size bytes, which are overwritten: --destroy says you mean it. With --emulate the
target is an emulated SSD on a virtual clock, whose true geometry is printed beside
the verdicts.

EXAMPLES
    lamina probe /dev/nvme1n1 --size 8G --destroy
    lamina probe --emulate tlc,capacity=1G,iu=16K,channels=4,dies=2";

#[derive(clap::Args)]
struct ProbeArgs {
    /// The device or file to probe (its first --size bytes are overwritten).
    #[arg(required_unless_present = "emulate", conflicts_with = "emulate")]
    device: Option<PathBuf>,
    /// How much of the device to use.
    #[arg(long, default_value = "1G", value_name = "SIZE")]
    size: String,
    /// Confirms that the data on the probed part of the device may be destroyed.
    #[arg(long)]
    destroy: bool,
    /// Probe an emulated SSD instead: cell type and settings, comma-separated
    /// (capacity, iu, page, pages-per-block, channels, dies; `lba` for a drive
    /// that places data by logical address instead of write order).
    #[arg(long, value_name = "SPEC")]
    emulate: Option<String>,
    #[arg(long)]
    json: bool,
}

const SERVE_ABOUT: &str = "\
Serve every volume of the array in DIR as an NBD export named after the volume
(the empty export name selects the first volume).

Without DIR, ./lamina-data is used; if it holds no array, an embedded default is
created there: one sparse backing file (--default-size) and one volume `default`
filling it. The server prints how to connect (nbdinfo, nbdfuse + losetup,
nbd-client, qemu).

Writes are acknowledged from RAM; NBD_CMD_FLUSH and FUA make them durable.
SIGINT or SIGTERM flushes, writes a checkpoint and exits; SIGHUP reopens the log
and writes a checkpoint.

Under systemd, run it as a Type=notify service (contrib/systemd/lamina@.service):
it reports READY=1 once the array is open and every listener bound, and
STOPPING=1 when it starts to shut down (sd_notify, through $NOTIFY_SOCKET).";

const STATUS_ABOUT: &str = "\
Report an array's capacity, segment use, bytes written by users and to media, bytes
relocated by garbage collection, and write amplification (media / user), overall
and per volume. Asks the running server through its admin socket; for a stopped
array it recovers the state read-only from the devices.

With --json the keys are a stable interface: capacity_bytes, usable_bytes,
live_bytes, maps_bytes (what the volumes' maps take in the checkpoints beyond the room
usable_bytes leaves them, from snapshots and clones or writes scattered over a thin
volume: in use as live data is), volume_ids_left (ids left of 65535: every volume, snapshot, clone and
rollback holds one until it is deleted), segment_count, used_segments, free_segments,
user_bytes_written, media_bytes_written, gc_bytes_relocated, metadata_bytes_written,
write_amplification, gc_floor_waits (times user writes waited at the user floor
for garbage collection to free a segment), gc_pace_waits (times they waited for GC
to earn them room, between its start watermark and the floor), segments_discarded
(TRIMs of free segments since the array was opened) and segments_tail_discarded
(those that kept the segment's first unit header, which recovery reads), and volumes[] with the same per-volume keys (plus classes[]
per heat class). Arrays: array.members[] (index, name, state ok/failed/rebuilding,
bytes_written, bytes_read, read_errors, checksum_errors, write_errors,
rebuild_progress), array.redundancy_left,
array.wear_spread, pad_bytes_written, blocks_rebuilt_from_parity,
segments_repaired. Zoned arrays: array.zones_open (zones held by open or closing
segments) and array.zone_open_limit (0: none).";

#[derive(Subcommand)]
enum ArrayCmd {
    /// Create an array in DIR from one or more devices.
    #[command(long_about = ARRAY_CREATE_ABOUT)]
    Create(ArrayCreateArgs),
    /// Take a member device out of service (as `mdadm --fail`): the array serves
    /// on from the others and their parity (a said5/6 member, or a copy of a
    /// mirrored cache tier).
    Fail {
        dir: PathBuf,
        /// The member: its index (as `lamina status` lists them) or its path.
        #[arg(long, value_name = "N|PATH")]
        device: String,
    },
    /// Put a new device in place of a failed member and rebuild it (online when
    /// the server runs).
    #[command(long_about = ARRAY_REPLACE_ABOUT)]
    Replace(ArrayReplaceArgs),
    /// Add devices to a JBOD array (as `zpool add`, `vgextend`): its capacity
    /// grows by theirs; nothing stored moves.
    #[command(long_about = ARRAY_GROW_ABOUT)]
    Grow {
        dir: PathBuf,
        /// A device to add: PATH, or PATH:SIZE to create a sparse file. Repeat for
        /// several.
        #[arg(long = "device", value_name = "PATH[:SIZE]", required = true)]
        devices: Vec<String>,
        /// Take devices that hold another array's superblock.
        #[arg(long)]
        force: bool,
        /// Do not discard the new devices first.
        #[arg(long)]
        no_discard: bool,
    },
    /// Move everything off a JBOD member and take it out of the array (as
    /// `pvmove` then `vgreduce`).
    #[command(long_about = ARRAY_EVACUATE_ABOUT)]
    Evacuate {
        dir: PathBuf,
        /// The member: its index (as `lamina status` lists them) or its path.
        #[arg(long, value_name = "N|PATH")]
        device: String,
        /// The report as JSON.
        #[arg(long)]
        json: bool,
        /// No progress bar.
        #[arg(long, short)]
        quiet: bool,
    },
    /// List the arrays that devices hold (as `mdadm --examine --scan`).
    ///
    /// PATHs are devices, or directories whose files and block devices are looked
    /// at; without any, every block device the kernel lists. For each array: its
    /// name, UUID, layout, members found and whether it can be served (complete,
    /// degraded, incomplete).
    List {
        /// Devices or directories of them.
        paths: Vec<PathBuf>,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Serve an array found on devices from DIR (as `zpool import`).
    ///
    /// Looks for the array's members among PATHs (devices or directories of them;
    /// without any: the devices an exported DIR names, else every block device) and
    /// writes DIR/lamina.toml for it, with the settings an export kept. Several
    /// arrays found: say which with --name or --uuid. Members missing that the
    /// layout's parity covers are imported as absent (the array serves degraded);
    /// more missing is refused.
    Import {
        dir: PathBuf,
        /// Devices or directories of them.
        paths: Vec<PathBuf>,
        /// The array's name (as `array list` shows it).
        #[arg(long)]
        name: Option<String>,
        /// The array's UUID.
        #[arg(long, conflicts_with = "name")]
        uuid: Option<String>,
        /// Import it even with members missing (those its parity covers): it is
        /// served degraded until `array replace` rebuilds them.
        #[arg(long)]
        degraded: bool,
    },
    /// Let go of the array in DIR (as `zpool export`): the server must be stopped;
    /// the devices keep everything, and `array import` serves them again, here or
    /// elsewhere.
    Export { dir: PathBuf },
    /// Wipe the superblocks of the array in DIR's devices (as `mdadm
    /// --zero-superblock` on each member) and remove its lamina.toml. Every volume
    /// becomes unreachable; the files and devices stay. Needs --force.
    Destroy {
        dir: PathBuf,
        /// Yes, destroy it.
        #[arg(long)]
        force: bool,
    },
    /// Verify checksums and parity of every live stripe and repair what can be.
    #[command(long_about = ARRAY_SCRUB_ABOUT)]
    Scrub {
        dir: PathBuf,
        /// The summary as JSON.
        #[arg(long)]
        json: bool,
        /// No progress bar.
        #[arg(long, short)]
        quiet: bool,
    },
}

const ARRAY_GROW_ABOUT: &str = "\
Add one or more devices to the JBOD array in DIR. Their segments are numbered
after the existing ones, so nothing stored moves; they add to the capacity at
once, and the allocator, which prefers the least-written member, fills them
first. Each new
device's data area is discarded first (--no-discard to skip it), as at creation.

The server must be stopped (the array is opened here: what the last run left is
recovered and checkpointed first). The new devices are labelled, then recorded in
DIR/lamina.toml, then the old members' superblocks name them. Stopped before
lamina.toml changed, the array is as it was and the same command can be run again;
stopped after, the array opens grown, and its first read-write open (`lamina
serve`) writes the new superblock to every member.

Striped layouts (said0, said5, said6) would have to restripe every live segment
over the new member count, and zoned arrays to match zones: both are refused, as
is an array with a cache tier (its segments are numbered after the capacity
tier's).

EXIT STATUS
    0  the array grew
    1  it did not (the message says why; nothing changed unless it says so)
    2  bad usage

EXAMPLE
    lamina array grow /srv/tank --device /dev/sdc --device /dev/sdd";

const ARRAY_EVACUATE_ABOUT: &str = "\
Move every block that member N of the JBOD array in DIR holds onto the other
members, then take N out of the array: its device is no longer needed, and
DIR/lamina.toml stops naming it. The array's capacity shrinks by the member's;
the others must have room for everything the array stores (checked first).

The server must be stopped. The member's segments are taken out of use first
and a checkpoint is written; then garbage collection moves the segments that
hold data (whatever their garbage) and checkpoints release them; then the
superblocks record the member as removed. Interrupted (a crash, an error), the
array opens as it was, with the member holding less, and the command can be run
again. Segments holding blocks that failed verification cannot be moved: the
command says which and removes nothing.

A removed member keeps its place in the array's table of members (the segments
of the members after it keep their numbers), shown as \"removed\" by `status` and
`array list`.

On an array with a cache tier, a capacity member is evacuated onto the other
capacity members; the cache member itself cannot be (that would remove the
cache; `array replace` moves it to another device).

EXIT STATUS
    0  the member was removed
    1  it was not (the message says why)
    2  bad usage

EXAMPLE
    lamina array evacuate /srv/tank --device /dev/sdb";

const ARRAY_SCRUB_ABOUT: &str = "\
Read every segment that holds data, check each data block against the CRC-32C its
unit header records and each stripe row against its parity, and repair what the
parity allows: a data block whose checksum fails is rebuilt from the rest of its
row and written back; parity that does not match good data is recomputed. JBOD
and SAID0 have no parity: scrub reports what it finds.

Runs inside the server when it is up (clients keep working), else here.

EXIT STATUS
    0  nothing wrong, or everything found was repaired
    1  the scrub could not run (the message says why)
    2  bad usage
    4  damage remains (unrecoverable blocks, parity mismatches with no culprit, or
       unit headers damaged so that the units after them cannot be checked), as
       `lamina fsck` says it";

const ARRAY_REPLACE_ABOUT: &str = "\
Put a new device in the place of failed member N of a striped array (said5,
said6) and rebuild its share of every stripe that holds data from the other
members' data and parity. Free stripes are skipped: a log-structured array knows
which stripes are in use, so a rebuild moves the used space, not the device size.
A failed copy of a mirrored cache tier is replaced the same way: the new device
gets the cache segments in use, copied from another copy.

On a JBOD array, move member N (healthy, or failing but still readable) to the new
device, as `pvmove` onto a new disk: its segments that hold data are copied to the
same offsets of the new device, which must be at least as large as the member's
segments need, and takes its place; the old device keeps its contents. This runs
with the server stopped. A segment the old device cannot read stops it with
nothing changed: JBOD has no other copy. The capacity members of an array with a
cache tier, and its cache device when it is not mirrored, are moved this way
(not when the capacity devices are zoned).

When `lamina serve` runs, the rebuild runs inside it while clients keep working,
at most --rate bytes per second; this command shows its progress until it is done
(or returns at once with --no-wait). Otherwise the rebuild runs here. Progress is
recorded in the superblocks every few seconds: an interrupted rebuild resumes
when the array is opened again.

EXAMPLE
    lamina array fail /srv/tank --device 2
    lamina array replace /srv/tank --old 2 --new /dev/sdx --rate 200M";

#[derive(clap::Args)]
struct ArrayReplaceArgs {
    dir: PathBuf,
    /// The failed member: its index (as `lamina status` lists them) or its path.
    #[arg(long, value_name = "N|PATH")]
    old: String,
    /// The new device: PATH or PATH:SIZE (creates a sparse file).
    #[arg(long, value_name = "PATH[:SIZE]")]
    new: String,
    /// Most bytes per second the rebuild writes (K, M, G suffixes); unlimited by
    /// default.
    #[arg(long, value_name = "SIZE")]
    rate: Option<String>,
    /// Reuse a device that holds a Lamina superblock.
    #[arg(long)]
    force: bool,
    /// Return once the rebuild has started (server only).
    #[arg(long)]
    no_wait: bool,
    /// Rebuild every stripe, also the free ones, as a RAID that does not know
    /// what is in use must (offline only; for comparisons).
    #[arg(long)]
    whole_device: bool,
    /// No progress bar.
    #[arg(long, short)]
    quiet: bool,
    /// Print the rebuild's report as JSON (offline rebuilds).
    #[arg(long)]
    json: bool,
}

const ARRAY_CREATE_ABOUT: &str = "\
Create an array in DIR from one or more devices. A device is a block device or a
regular file; PATH:SIZE creates a sparse file of SIZE when PATH does not exist.
SIZE accepts K, M, G, T suffixes (powers of 1024).

Devices that already belong to a Lamina array are refused unless --force is given.

A CACHE TIER (--cache-device FAST) puts a fast device (an SLC or Optane SSD) in
front of slow or low-endurance ones (a QLC SSD, an HDD), as CSAL does: every user
write lands in the cache's log first; compaction moves what is still live in the
cache's oldest segments to the capacity tier, in write units that fill its
segments in order, so the slow devices see user data only as large sequential
writes, and blocks overwritten while in the cache never reach them (checkpoints
and the log's own records go to the capacity tier too). Usable capacity
is the capacity tier's. Reads are served from whichever tier holds the block.

Two or three --cache-device options make a MIRROR: each device holds every cache
segment (as many as the smallest holds), every write goes to all of them, and
the array keeps serving while one copy is left; `lamina array fail` and
`lamina array replace` work on a copy as on a member of a said5 array, and a
replaced copy is rebuilt from another, online. Without a mirror, or with every
copy lost, the array is not served and says what each volume lost: the cache
holds the only copy of what it has not compacted.

In front of ZONED capacity devices (ZNS SSDs, host-managed SMR disks) the cache
is conventional and its segments are zone-sized: user writes never touch a zone;
compaction and garbage collection fill zones from their start, and only their
streams count against the devices' open-zone limit.

EXAMPLE
    lamina array create /srv/tank --device /var/lib/tank/a.img:100G --overprovision 0.2
    lamina volume create /srv/tank vm1 --size 40G
    lamina serve /srv/tank
    lamina array create /srv/qlc --device /dev/sdb --cache-device /dev/nvme0n1p1
    lamina array create /srv/qlc --device /dev/sdb --cache-device /dev/nvme0n1p1 \
        --cache-device /dev/nvme1n1p1";

#[derive(clap::Args)]
struct ArrayCreateArgs {
    /// Directory for the array's configuration (created if missing).
    dir: PathBuf,
    /// A device: PATH or PATH:SIZE (repeat for more devices).
    #[arg(
        long = "device",
        short = 'd',
        required = true,
        value_name = "PATH[:SIZE]"
    )]
    devices: Vec<String>,
    /// A fast device for the cache tier, PATH or PATH:SIZE; two or three mirror
    /// each other: every user write lands there first, and compaction moves what
    /// is still live to the --device members, the capacity tier, in whole
    /// segments. With jbod only.
    #[arg(long = "cache-device", value_name = "PATH[:SIZE]")]
    cache_devices: Vec<String>,
    /// Segment size: the unit of allocation and garbage collection.
    #[arg(long, default_value = "8M", value_name = "SIZE")]
    segment_size: String,
    /// Write unit: the size of each sequential device write [default: 512K, or a
    /// quarter of --segment-size when that is smaller: a segment holds at least
    /// four units].
    #[arg(long, value_name = "SIZE")]
    write_unit: Option<String>,
    /// Spare space as a fraction of user space (0.10 keeps 10% spare for GC).
    #[arg(long, default_value_t = 0.10, value_name = "FRACTION")]
    overprovision: f64,
    /// How segments are spread over devices: jbod (each segment on one device),
    /// said0 (striped), said5 (striped, one parity chunk per stripe, needs 3+
    /// devices), said6 (two parity chunks, needs 4+ devices). For striped layouts
    /// --segment-size is each device's chunk of a stripe.
    #[arg(long, default_value = "jbod", value_parser = ["jbod", "said0", "said5", "said6"])]
    layout: String,
    /// Name of the array (default: the directory's name).
    #[arg(long)]
    name: Option<String>,
    /// Overwrite devices that belong to another Lamina array.
    #[arg(long)]
    force: bool,
    /// Do not discard the devices' data areas first. By default they are discarded
    /// (TRIM on an SSD, holes in a file), as mkfs does, so that a drive's own
    /// garbage collection does not keep copying what it held before.
    #[arg(long)]
    no_discard: bool,
    /// Emulate zoned devices on the files: `smr` (host-managed SMR) or `zns`,
    /// with settings `zone=SIZE,cap=SIZE,conv=N,open=N,active=N` (for example
    /// `zns,zone=4M,cap=3M`). A segment becomes one zone (per data member), the
    /// superblocks live in the conventional zones, and the zone state is kept in
    /// PATH.zones beside each file. Cache devices stay conventional: with
    /// --cache-device this is CSAL's cache in front of ZNS drives.
    #[arg(long, value_name = "SPEC")]
    zoned: Option<String>,
    /// Also serve NBD on this TCP address (written to lamina.toml as `[serve]
    /// tcp`); without it the array is served on its Unix socket only, so that
    /// arrays do not compete for one port.
    #[arg(long, value_name = "HOST:PORT")]
    tcp: Option<String>,
}

#[derive(Subcommand)]
enum VolumeCmd {
    /// Create a thin-provisioned volume.
    Create {
        /// [DIR] NAME: the array directory (default ./lamina-data) and the
        /// volume's name.
        #[arg(required = true, num_args = 1..=2, value_name = "[DIR] NAME")]
        args: Vec<String>,
        /// Size of the volume (K, M, G, T suffixes); a multiple of 4 KiB.
        #[arg(long, value_name = "SIZE")]
        size: String,
    },
    /// Limit a volume's requests and bytes per second, live and for good.
    ///
    /// Without --iops and --bandwidth: show its limits. Limits set here apply at
    /// once on the running server (its open connections too) and are written to
    /// lamina.toml (`[engine.volumes.NAME] iops_limit`, `bandwidth_limit`, other
    /// lines left as they are), so that they hold at every start; without a server
    /// they are only written there. --live-only leaves lamina.toml alone.
    #[command(
        after_help = "Examples:\n  lamina volume qos /srv/tank vm1 --iops 5000 --bandwidth 100M\n  lamina volume qos /srv/tank vm1 --iops none\n  lamina volume qos /srv/tank vm1"
    )]
    Qos {
        /// [DIR] NAME: the array directory (default ./lamina-data) and the
        /// volume's name.
        #[arg(required = true, num_args = 1..=2, value_name = "[DIR] NAME")]
        args: Vec<String>,
        /// Requests per second (reads, writes, trims, zeroes together), or `none`.
        #[arg(long, value_name = "N|none")]
        iops: Option<String>,
        /// Payload bytes per second (K, M, G suffixes), or `none`.
        #[arg(long, value_name = "SIZE|none")]
        bandwidth: Option<String>,
        /// Set the limits on the running server only, until it stops.
        #[arg(long)]
        live_only: bool,
    },
    /// Grow or shrink a volume, online.
    ///
    /// Growing takes effect at once for new connections (the blocks added are
    /// unmapped, so it costs nothing until written); clients connected before keep
    /// the size they were told. Shrinking is refused while blocks beyond the new end
    /// hold data, unless --force is given, which discards them (they are trimmed
    /// first). Clients connected before a shrink get EIO beyond the new end.
    #[command(
        after_help = "Examples:\n  lamina volume resize /srv/tank vm1 --size 80G\n  lamina volume resize /srv/tank vm1 --size +20G\n  lamina volume resize /srv/tank vm1 --size -10G --force"
    )]
    Resize {
        /// [DIR] NAME: the array directory (default ./lamina-data) and the
        /// volume's name.
        #[arg(required = true, num_args = 1..=2, value_name = "[DIR] NAME")]
        args: Vec<String>,
        /// The new size (K, M, G, T suffixes; a multiple of 4 KiB), or +SIZE / -SIZE
        /// relative to the current one.
        #[arg(long, value_name = "[+|-]SIZE", allow_hyphen_values = true)]
        size: String,
        /// Shrink even when the blocks cut off hold data (they are discarded).
        #[arg(long)]
        force: bool,
    },
    /// Rename a volume, online: new connections use the new name; open ones go on.
    ///
    /// The volume's section in lamina.toml (`[engine.volumes.NAME]`) is renamed with
    /// it, and limits set with `lamina volume qos` follow it.
    #[command(after_help = "Example:\n  lamina volume rename /srv/tank vm1 web1")]
    Rename {
        /// [DIR] NAME NEW_NAME: the array directory (default ./lamina-data), the
        /// volume's name and the one it takes.
        #[arg(required = true, num_args = 2..=3, value_name = "[DIR] NAME NEW_NAME")]
        args: Vec<String>,
    },
    /// Take a read-only snapshot of a volume, online, in a moment: a point in time
    /// holding every write acknowledged before it (as `zfs snapshot`,
    /// `lvcreate --snapshot`).
    ///
    /// The snapshot shares the volume's blocks; only blocks the volume overwrites
    /// afterwards take space of their own. It is served as a read-only export under
    /// its own name (writes get EPERM). `volume list` shows what each volume maps
    /// (LIVE) and what deleting it would free (EXCLUSIVE). A volume cannot be
    /// deleted while snapshots or clones made from it exist.
    #[command(after_help = "Example:
  lamina volume snapshot /srv/tank vm1 vm1-before-upgrade")]
    Snapshot {
        /// [DIR] NAME SNAPSHOT: the array directory (default ./lamina-data), the
        /// volume and the snapshot's name (the rules of a volume name).
        #[arg(required = true, num_args = 2..=3, value_name = "[DIR] NAME SNAPSHOT")]
        args: Vec<String>,
    },
    /// Make a writable clone of a snapshot (or of a volume), online, in a moment
    /// (as `zfs clone`): it shares every block it does not overwrite.
    ///
    /// A clone promises its full size, like a new volume (checked against
    /// max_overcommit). Clones of one golden image give each VM its own disk for
    /// the space of what it changes.
    #[command(after_help = "Example:
  lamina volume clone /srv/tank golden@base vm7")]
    Clone {
        /// [DIR] SNAPSHOT NEW_NAME: the array directory (default ./lamina-data),
        /// the snapshot (or volume) to clone and the clone's name.
        #[arg(required = true, num_args = 2..=3, value_name = "[DIR] SNAPSHOT NEW_NAME")]
        args: Vec<String>,
    },
    /// Give a volume the contents of one of its snapshots again (as `zfs rollback`,
    /// `lvconvert --merge`): everything written since the snapshot is gone.
    ///
    /// Online, but the volume must have no clients (--force disconnects them): they
    /// would see its contents change under them. The snapshot stays. What only the
    /// volume held is freed once the rollback is durable; a crash before the command
    /// returns leaves the volume as it was.
    #[command(after_help = "Example:\n  lamina volume rollback /srv/tank vm1 vm1-before-upgrade")]
    Rollback {
        /// [DIR] NAME SNAPSHOT: the array directory (default ./lamina-data), the
        /// volume and its snapshot.
        #[arg(required = true, num_args = 2..=3, value_name = "[DIR] NAME SNAPSHOT")]
        args: Vec<String>,
        /// Disconnect the volume's clients first.
        #[arg(long)]
        force: bool,
    },
    /// List volumes: size, what each maps (LIVE), what deleting it would free
    /// (EXCLUSIVE), and for snapshots and clones their type and origin.
    List {
        /// Array directory (default ./lamina-data).
        dir: Option<PathBuf>,
        #[arg(long)]
        json: bool,
        /// Only snapshots (as `zfs list -t snapshot`).
        #[arg(long)]
        snapshots: bool,
    },
    /// Delete a volume and release its space. A volume with clients connected is
    /// refused unless --force is given.
    Delete {
        /// [DIR] NAME: the array directory (default ./lamina-data) and the
        /// volume's name.
        #[arg(required = true, num_args = 1..=2, value_name = "[DIR] NAME")]
        args: Vec<String>,
        /// Delete even while clients are connected: they are disconnected first.
        #[arg(long)]
        force: bool,
    },
}

#[derive(clap::Args)]
struct StatusArgs {
    /// Array directory (default ./lamina-data).
    dir: Option<PathBuf>,
    /// Machine-readable output.
    #[arg(long)]
    json: bool,
    /// Prometheus text format.
    #[arg(long, conflicts_with = "json")]
    prometheus: bool,
}

fn main() {
    let cli = Cli::parse();
    // A reader of standard output that goes away early (`lamina volume list |
    // head -1`): `println!` panics on the broken pipe (Rust ignores SIGPIPE, which
    // the servers rely on). That one panic ends the command quietly with the
    // status a SIGPIPE gives (141, as `ls | head` under `set -o pipefail`): not 0,
    // since what it did not print may have been a failure (fsck's report) or it
    // may not have finished; every other panic is reported.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<String>()
            .map(String::as_str)
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(128 + libc::SIGPIPE);
        }
        report(info)
    }));
    let result = match cli.cmd {
        Cmd::Array(ArrayCmd::Create(a)) => array_create(a),
        Cmd::Array(ArrayCmd::Fail { dir, device }) => array_fail(&dir, &device),
        Cmd::Array(ArrayCmd::Replace(a)) => array_replace(a),
        Cmd::Array(ArrayCmd::Evacuate {
            dir,
            device,
            json,
            quiet,
        }) => array_evacuate(&dir, &device, json, quiet),
        Cmd::Array(ArrayCmd::Grow {
            dir,
            devices,
            force,
            no_discard,
        }) => devices
            .iter()
            .map(|d| parse_device(d))
            .collect::<Result<Vec<_>>>()
            .and_then(|specs| arrays::grow(&dir, &specs, force, !no_discard)),
        Cmd::Array(ArrayCmd::Scrub { dir, json, quiet }) => array_scrub(&dir, json, quiet),
        Cmd::Array(ArrayCmd::List { paths, json }) => arrays::list(&paths, json),
        Cmd::Array(ArrayCmd::Import {
            dir,
            paths,
            name,
            uuid,
            degraded,
        }) => arrays::import(&dir, &paths, name.as_deref(), uuid.as_deref(), degraded),
        Cmd::Array(ArrayCmd::Export { dir }) => arrays::export(&dir),
        Cmd::Array(ArrayCmd::Destroy { dir, force }) => arrays::destroy(&dir, force),
        Cmd::Volume(v) => volume(v),
        Cmd::Serve(a) => serve::run(a),
        Cmd::Status(a) => status(a),
        Cmd::Sim(a) => sim::run(*a),
        Cmd::Bench(b) => bench::run(b),
        Cmd::Fsck {
            dir,
            repair,
            data,
            json,
        } => fsck::run(&dir, repair, data, json),
        Cmd::Completions { shell } => {
            use clap::CommandFactory;
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "lamina", &mut script);
            to_stdout(&script)
        }
        Cmd::Man { dir } => man(dir.as_deref()),
        Cmd::Emulate(a) => emulate::run(a),
        Cmd::Top(a) => {
            if !(0.1..=3600.0).contains(&a.interval) {
                eprintln!(
                    "lamina: error: --interval {}: give 0.1 to 3600 seconds",
                    a.interval
                );
                std::process::exit(2);
            }
            absolute(&a.dir.unwrap_or_else(default_dir)).and_then(|dir| {
                top::run(
                    &dir,
                    std::time::Duration::from_secs_f64(a.interval),
                    a.count,
                )
            })
        }
        Cmd::Probe(a) => match (&a.emulate, &a.device) {
            (Some(spec), _) => bench::probe_emulated(spec, a.json),
            (None, Some(dev)) => size_arg("--size", &a.size)
                .and_then(|size| bench::probe_device(dev, size, a.destroy, a.json)),
            (None, None) => unreachable!("clap requires one"),
        },
    };
    if let Err(e) = result {
        eprintln!("lamina: error: {e:#}");
        // A mistake in how the command was called exits 2, as clap's own do.
        let usage = e.chain().any(|c| c.is::<Usage>());
        std::process::exit(if usage { 2 } else { 1 });
    }
}

/// A mistake in the command line itself (a value clap takes as text and Lamina
/// parses later, such as a size): exit status 2, bad usage.
#[derive(Debug)]
pub struct Usage(pub String);

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Usage {}

/// A size given on the command line; a bad one is a usage error (exit 2).
pub fn size_arg(what: &str, s: &str) -> Result<u64> {
    parse_size(s).map_err(|e| anyhow::Error::new(Usage(format!("{what}: {e}"))))
}

/// A member of the array named on the command line by its index or by its path
/// (as `array create --device` took it; relative to the current directory).
fn member_arg(st: &lamina_core::StatusReport, what: &str, s: &str) -> Result<usize> {
    let n = st.members.len();
    if n == 0 {
        return Err(Usage(format!(
            "{what} {s}: no member {s}: a {} array has no members to fail or replace",
            st.layout
        ))
        .into());
    }
    if let Ok(i) = s.parse::<usize>() {
        if i >= n {
            return Err(Usage(format!(
                "{what} {i}: no member {i}; the array has members 0 to {}",
                n - 1
            ))
            .into());
        }
        return Ok(i);
    }
    let canon = |p: &Path| p.canonicalize().unwrap_or_else(|_| p.to_path_buf());
    let want = canon(&absolute(Path::new(s))?);
    st.members
        .iter()
        .position(|m| canon(Path::new(&m.name)) == want)
        .ok_or_else(|| {
            let names: Vec<String> = st
                .members
                .iter()
                .map(|m| format!("{} {}", m.index, m.name))
                .collect();
            Usage(format!(
                "{what} {s}: not a member of the array (members: {})",
                names.join(", ")
            ))
            .into()
        })
}

/// `lamina man`: the pages into `dir`, or lamina(1) to standard output.
fn man(dir: Option<&Path>) -> Result<()> {
    use clap::CommandFactory;
    let Some(dir) = dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(Cli::command()).render(&mut page)?;
        return to_stdout(&page);
    };
    std::fs::create_dir_all(dir).with_context(|| format!("cannot make {}", dir.display()))?;
    clap_mangen::generate_to(Cli::command(), dir)
        .with_context(|| format!("cannot write the manual pages into {}", dir.display()))?;
    let mut pages: Vec<_> = std::fs::read_dir(dir)?
        .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
        .filter(|n| n.starts_with("lamina") && n.ends_with(".1"))
        .collect();
    pages.sort();
    for p in pages {
        println!("{}", dir.join(p).display());
    }
    Ok(())
}

/// Writes `bytes` to standard output; a reader that went away early (`| head`) is
/// not an error.
fn to_stdout(bytes: &[u8]) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|_| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(e).context("cannot write to standard output")
        }
        _ => Ok(()),
    }
}

pub fn default_dir() -> PathBuf {
    PathBuf::from("lamina-data")
}

fn absolute(p: &Path) -> Result<PathBuf> {
    std::path::absolute(p).with_context(|| format!("bad path {}", p.display()))
}

/// Splits `PATH[:SIZE]`.
fn parse_device(spec: &str) -> Result<(PathBuf, Option<u64>)> {
    if let Some((p, s)) = spec.rsplit_once(':') {
        if let Ok(size) = parse_size(s) {
            return Ok((PathBuf::from(p), Some(size)));
        }
    }
    Ok((PathBuf::from(spec), None))
}

fn array_evacuate(dir: &Path, device: &str, as_json: bool, quiet: bool) -> Result<()> {
    let dir = absolute(dir)?;
    let (st, _) = get_status(&dir)?;
    let index = member_arg(&st, "--device", device)?;
    let name = st.members[index].name.clone();
    arrays::evacuate(
        &dir,
        index,
        &name,
        st.members[index].state == "removed",
        as_json,
        quiet,
    )
}

fn array_replace(a: ArrayReplaceArgs) -> Result<()> {
    let dir = absolute(&a.dir)?;
    let (path, size) = parse_device(&a.new)?;
    let path = absolute(&path)?;
    let rate = a
        .rate
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    let (before, running) = get_status(&dir)?;
    let old = member_arg(&before, "--old", &a.old)?;
    let old_name = before.members[old].name.clone();
    // A copy of a mirrored cache tier is rebuilt from the other copies, as a
    // striped member is; any other JBOD member is copied.
    let mirror_copy = before.members[old].tier == "cache" && mirrored_cache(&before);
    if before.layout == "jbod" && !mirror_copy {
        if rate.is_some() || a.whole_device || a.no_wait {
            return Err(Usage(
                "--rate, --whole-device and --no-wait are for rebuilds of striped members; a JBOD member is copied with the server stopped".into(),
            )
            .into());
        }
        return arrays::replace_jbod(&dir, old, &old_name, &path, size, a.force, a.quiet, a.json);
    }
    let size = if rebuild::prepare_zoned(&old_name, &path, size)? {
        None
    } else {
        size
    };
    let req = json!({"op": "member-replace", "index": old, "path": path, "size": size,
                     "force": a.force, "rate": rate});
    let bar = |quiet: bool| {
        progress_bar(
            quiet,
            100,
            "rebuild {bar:40} {percent}% of stripes  {elapsed} (eta {eta})",
        )
    };
    if a.whole_device && running {
        bail!("--whole-device runs offline only; stop the server first");
    }
    if running && admin::request(&admin_socket(&dir)?, &req)?.is_some() {
        rebuild::update_config(&dir, &old_name, &path)?;
        println!(
            "member {} replaced by {}; rebuilding in the server",
            old,
            path.display()
        );
        if a.no_wait {
            return Ok(());
        }
        let pb = bar(a.quiet);
        // A rebuild thread holds the member from its start (one of an earlier
        // device in the slot holds it until it stops, and the new one takes it
        // within 50 ms): none for this long means the rebuild stopped.
        let mut idle_since: Option<std::time::Instant> = None;
        loop {
            let (s, running) = get_status(&dir)?;
            let m = &s.members[old];
            let idle = m.state == "rebuilding" && !m.rebuild_running;
            let since = if idle {
                *idle_since.get_or_insert_with(std::time::Instant::now)
            } else {
                std::time::Instant::now()
            };
            idle_since = idle.then_some(since);
            if since.elapsed() > std::time::Duration::from_secs(10) {
                bail!(
                    "the rebuild of member {old} stopped at {:.0}% (see the server log); it resumes when the server starts again",
                    m.rebuild_progress.unwrap_or(0.0) * 100.0
                );
            }
            match (m.state.as_str(), m.rebuild_progress) {
                ("rebuilding", Some(p)) => pb.set_position((p * 100.0) as u64),
                ("ok", _) => break,
                (state, _) => bail!(
                    "member {} is {state}: the rebuild stopped (see the server log)",
                    old
                ),
            }
            if !running {
                bail!("the server stopped; the rebuild resumes when it starts again");
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        pb.finish();
        println!("member {} rebuilt", old);
        return Ok(());
    }
    // Offline: run the engine here.
    let cfg = Config::load(&dir)?;
    let (engine, _) = open_array(&dir, OpenMode::ReadWrite)?;
    let rt = runtime::Runtime::start(engine, cfg.serve.io_threads, cfg.serve.io_nice()?);
    let result = (|| -> Result<lamina_core::rebuild::RebuildReport> {
        let dev = rebuild::open_new_device(&path, size, a.force, cfg.io_options()?)?;
        rebuild::replace(&rt, old, dev)?;
        rebuild::update_config(&dir, &old_name, &path)?;
        let pb = bar(a.quiet);
        let r = rebuild::run(&rt, old, rate, a.whole_device, &mut |d, t| {
            pb.set_position(d * 100 / t.max(1));
        })?;
        pb.finish();
        Ok(r)
    })();
    rt.shutdown()?;
    let r = result?;
    if a.json {
        println!(
            "{}",
            json!({
                "member": old,
                "seconds": r.elapsed.as_secs_f64(),
                "stripes_visited": r.stripes_visited,
                "stripes_rebuilt": r.stripes_rebuilt,
                "bytes_written": r.bytes_written,
                "whole_device_bytes": r.whole_device_bytes,
            })
        );
        return Ok(());
    }
    println!(
        "member {} rebuilt in {:.1}s: {} of {} stripes held data; wrote {} (a whole-device rebuild writes {})",
        old,
        r.elapsed.as_secs_f64(),
        r.stripes_rebuilt,
        r.stripes_visited,
        human(r.bytes_written),
        human(r.whole_device_bytes)
    );
    Ok(())
}

fn array_scrub(dir: &Path, json_out: bool, quiet: bool) -> Result<()> {
    let dir = absolute(dir)?;
    let pb = progress_bar(
        quiet || json_out,
        1,
        "scrub {bar:40} {pos}/{len} segments  {elapsed}",
    );
    let mut progress = |d: u64, t: u64| {
        pb.set_length(t);
        pb.set_position(d);
    };
    let req = json!({"op": "scrub"});
    let v = match admin::request_with_progress(&admin_socket(&dir)?, &req, &mut progress)? {
        Some(v) => v["scrub"].clone(),
        None => {
            let (mut engine, _) = open_array(&dir, OpenMode::ReadWrite)?;
            let r = lamina_core::scrub::scrub_inline(&mut engine, &mut progress)?;
            admin::scrub_json(&r)
        }
    };
    pb.finish_and_clear();
    let n = |k: &str| v[k].as_u64().unwrap_or(0);
    if json_out {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!(
            "scrubbed {} segments ({} units, {} data blocks, {} stripe rows)",
            n("segments"),
            n("units"),
            n("blocks_checked"),
            n("rows_checked")
        );
        println!(
            "  checksum errors {}, parity mismatches {}, unit headers found by parity {}\n  repaired: {} data blocks, {} parity blocks\n  unresolved {}, unrecoverable {}, damaged unit headers {}",
            n("checksum_errors"),
            n("parity_mismatches"),
            n("unit_headers_rebuilt"),
            n("blocks_repaired"),
            n("parity_repaired"),
            n("unresolved"),
            n("unrecoverable"),
            n("damaged_unit_headers")
        );
        if n("segments_changed_while_read") > 0 {
            println!(
                "  {} segments emptied or reused while read: skipped (nothing in them is read any more)",
                n("segments_changed_while_read")
            );
        }
        if let Some(e) = v["checkpoint_error"].as_str() {
            println!("  the checkpoint that ends the scrub failed: {e}");
        }
    }
    if n("damage_left") > 0 {
        std::process::exit(4);
    }
    Ok(())
}

fn random_uuid() -> [u8; 16] {
    let mut u: [u8; 16] = rand::random();
    u[6] = (u[6] & 0x0f) | 0x40;
    u[8] = (u[8] & 0x3f) | 0x80;
    u
}

fn size_in_blocks(what: &str, s: &str) -> Result<u32> {
    let bytes = size_arg(what, s)?;
    if bytes == 0 || bytes % 4096 != 0 || bytes / 4096 > u32::MAX as u64 {
        let e = format!("{what} {s} must be a positive multiple of 4 KiB");
        return Err(anyhow::Error::new(Usage(e)));
    }
    Ok((bytes / 4096) as u32)
}

/// Creates an array in `dir` (shared by `array create` and the embedded default).
pub fn create_array(
    dir: &Path,
    device_specs: &[(PathBuf, Option<u64>)],
    params: FormatParams,
    zoned: Option<&str>,
    tcp: Option<String>,
) -> Result<()> {
    if Config::exists(dir) {
        bail!(
            "{} already holds an array ({} exists)",
            dir.display(),
            Config::path(dir).display()
        );
    }
    // What this command makes goes again if it fails: a failed create leaves
    // nothing behind (devices that existed are not removed, though they may hold a
    // new superblock once formatting started).
    let mut created = Created::default();
    created.dirs(dir)?;
    let mut seen = std::collections::HashSet::new();
    let mut devices: Vec<Arc<dyn BlockDevice>> = Vec::new();
    let mut paths = Vec::new();
    // Cache devices (the last ones) stay conventional in front of zoned ones.
    let capacity = device_specs.len().saturating_sub(params.cache_devices);
    for (i, (p, size)) in device_specs.iter().enumerate() {
        let (abs, dev) = open_new_device(p, *size, &Default::default(), &mut seen, &mut created)?;
        match zoned.filter(|_| i < capacity) {
            Some(spec) => {
                // Its zone state file is ours to remove only if it was not there.
                let state = lamina_device::zoned::state_path(&abs);
                if state.symlink_metadata().is_err() {
                    created.files.push(state);
                }
                devices.push(devices::make_zoned(&abs, dev, spec)?);
            }
            None => {
                // Opening the array later would take the file for the emulated
                // zoned device it once was.
                let state = lamina_device::zoned::state_path(&abs);
                if abs.is_file() && state.exists() {
                    bail!(
                        "{} is to be a conventional device, but {} beside it holds the zone state \
                         of an emulated zoned device; remove it first",
                        abs.display(),
                        state.display()
                    );
                }
                devices.push(Arc::from(lamina_device::blkzoned::open_if_zoned(dev)?))
            }
        }
        paths.push(abs);
    }
    let uuids: Vec<[u8; 16]> = devices.iter().map(|_| random_uuid()).collect();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let array_uuid = random_uuid();
    lamina_core::format(&devices, &params, array_uuid, &uuids, now)?;
    // Opening writes the first checkpoint.
    let (engine, _) = lamina_core::open(devices, EngineConfig::default(), OpenMode::ReadWrite)?;
    drop(engine);
    let mut config = Config::new(paths);
    config.array_uuid = Some(labels::uuid_hex(&array_uuid));
    config.serve.tcp = tcp;
    created.files.push(Config::path(dir));
    config.save(dir)?;
    created.keep();
    Ok(())
}

/// A progress bar of `len` steps drawn with `template` (indicatif's), or a hidden
/// one (`--quiet`, `--json`). indicatif draws only on a terminal.
pub(crate) fn progress_bar(hidden: bool, len: u64, template: &str) -> indicatif::ProgressBar {
    let pb = if hidden {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(len)
    };
    pb.set_style(indicatif::ProgressStyle::with_template(template).expect("a valid template"));
    pb
}

/// A progress bar for discarding `what`, and the callback that moves it. Drawn
/// only on a terminal (indicatif hides it otherwise); finish it with
/// `finish_and_clear`.
pub(crate) fn discard_bar(what: &str) -> (indicatif::ProgressBar, lamina_core::recovery::Progress) {
    let pb = progress_bar(
        false,
        1,
        &format!("discarding {what} {{bar:40}} {{bytes}}/{{total_bytes}}  {{elapsed}}"),
    );
    let bar = pb.clone();
    let progress = lamina_core::recovery::Progress(Arc::new(move |done, total| {
        bar.set_length(total);
        bar.set_position(done);
    }));
    (pb, progress)
}

/// Opens the device a user named for a new member: PATH as it is, or PATH:SIZE,
/// which makes a sparse file of SIZE (remembered in `created`) unless it exists
/// with that size. `members`: the array's devices now (canonical paths), which
/// are refused; `seen` holds the devices named before: one named twice is refused.
pub(crate) fn open_new_device(
    p: &Path,
    size: Option<u64>,
    members: &std::collections::HashSet<PathBuf>,
    seen: &mut std::collections::HashSet<PathBuf>,
    created: &mut Created,
) -> Result<(PathBuf, FileDevice)> {
    let abs = absolute(p)?;
    let canon = abs.canonicalize().unwrap_or(abs.clone());
    if members.contains(&canon) {
        bail!("device {} is already a member", p.display());
    }
    if !seen.insert(canon) {
        bail!("device {} is listed twice", p.display());
    }
    let dev = if abs.exists() {
        let d = FileDevice::open(&abs, DevMode::ReadWrite)?;
        if let Some(s) = size {
            if !d.is_block_device() && d.size_bytes() != s {
                bail!(
                    "{} exists with {} bytes, not the {} given; omit :SIZE to use it as it is",
                    abs.display(),
                    d.size_bytes(),
                    s
                );
            }
        }
        d
    } else {
        let Some(s) = size else {
            bail!(
                "{} does not exist; give PATH:SIZE to create a sparse file",
                abs.display()
            );
        };
        if let Some(parent) = abs.parent() {
            created.dirs(parent)?;
        }
        // (`exists` is false for a dangling link too, which is not ours.)
        let d = FileDevice::create_sparse(&abs, s)?;
        created.files.push(abs.clone());
        d
    };
    Ok((abs, dev))
}

/// Files and directories a command made, removed again when it fails (dropped
/// without [`Created::keep`]).
#[derive(Default)]
pub(crate) struct Created {
    files: Vec<PathBuf>,
    /// Outermost first.
    dirs: Vec<PathBuf>,
}

impl Created {
    /// Makes `dir` and its missing parents, remembering each one made.
    fn dirs(&mut self, dir: &Path) -> Result<()> {
        let missing: Vec<PathBuf> = dir
            .ancestors()
            .take_while(|d| !d.as_os_str().is_empty() && !d.exists())
            .map(Path::to_path_buf)
            .collect();
        std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        self.dirs.extend(missing.into_iter().rev());
        Ok(())
    }

    pub(crate) fn keep(mut self) {
        self.files.clear();
        self.dirs.clear();
    }
}

impl Drop for Created {
    fn drop(&mut self) {
        for f in &self.files {
            let _ = std::fs::remove_file(f);
        }
        // Innermost first; a directory something else was put in stays.
        for d in self.dirs.iter().rev() {
            let _ = std::fs::remove_dir(d);
        }
    }
}

fn array_create(a: ArrayCreateArgs) -> Result<()> {
    let dir = absolute(&a.dir)?;
    let specs = a
        .devices
        .iter()
        .chain(&a.cache_devices)
        .map(|d| parse_device(d))
        .collect::<Result<Vec<_>>>()?;
    let layout = match a.layout.as_str() {
        "jbod" => Layout::Jbod,
        "said0" => Layout::Said0,
        "said5" => Layout::Said5,
        _ => Layout::Said6,
    };
    let name = a.name.unwrap_or_else(|| {
        dir.file_name()
            .map(|n| n.to_string_lossy().chars().take(63).collect())
            .unwrap_or_else(|| "lamina".into())
    });
    let segment_blocks = size_in_blocks("segment size", &a.segment_size)?;
    let write_unit_blocks = match &a.write_unit {
        Some(w) => size_in_blocks("write unit", w)?,
        None => (segment_blocks / 4).clamp(2, 128),
    };
    let params = FormatParams {
        name,
        layout,
        segment_blocks,
        write_unit_blocks,
        overprovision: a.overprovision,
        force: a.force,
        discard: !a.no_discard,
        progress: None,
        cache_devices: a.cache_devices.len(),
    };
    let (pb, progress) = discard_bar("members");
    let params = FormatParams {
        progress: Some(progress),
        ..params
    };
    let created = create_array(&dir, &specs, params, a.zoned.as_deref(), a.tcp);
    pb.finish_and_clear();
    created?;
    let (engine, _) = open_array(&dir, OpenMode::ReadOnly)?;
    let s = engine.status();
    println!(
        "created array {:?} in {}: {} device(s), capacity {}, usable {} ({} segments of {})",
        s.array_name,
        dir.display(),
        s.devices.len(),
        human(s.capacity_bytes),
        human(s.usable_bytes),
        s.segment_count,
        human(s.segment_size_bytes)
    );
    if let Some(c) = &s.cache {
        println!(
            "cache tier: {} segments ({}) in front of it{}",
            c.segment_count,
            human(c.segment_count * s.segment_size_bytes),
            if c.copies > 1 {
                format!(", mirrored on {} devices", c.copies)
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// Opens the devices listed in `dir`'s config and recovers the array.
pub fn open_array(
    dir: &Path,
    mode: OpenMode,
) -> Result<(lamina_core::Engine, lamina_core::RecoveryReport)> {
    let (devices, ec) = open_config_devices(dir, mode)?;
    Ok(lamina_core::open(devices, ec, mode)?)
}

/// The devices `dir`'s configuration lists, opened (one that cannot be is passed
/// on as absent), and the engine settings it gives.
pub(crate) fn open_config_devices(
    dir: &Path,
    mode: OpenMode,
) -> Result<(Vec<Arc<dyn BlockDevice>>, lamina_core::EngineConfig)> {
    let cfg = Config::load(dir)?;
    let paths: Vec<PathBuf> = cfg
        .devices
        .iter()
        .map(|p| Config::resolve(dir, p))
        .collect();
    labels::check_config_devices(dir, cfg.array_uuid.as_deref(), &paths)?;
    let dm = match mode {
        OpenMode::ReadWrite => DevMode::ReadWrite,
        OpenMode::ReadOnly => DevMode::ReadOnly,
    };
    let io = cfg.io_options()?;
    let mut devices: Vec<Arc<dyn BlockDevice>> = Vec::new();
    for p in &cfg.devices {
        let p = Config::resolve(dir, p);
        // A member that cannot be opened is passed on as absent: a striped array
        // with parity runs degraded without it, other layouts say what is missing.
        match devices::open_device(&p, dm, io) {
            Ok(d) => devices.push(d),
            Err(e) => {
                let name = p.display().to_string();
                let e = format!("{e:#}");
                let reason = e
                    .strip_prefix(&format!("{name}: "))
                    .unwrap_or(&e)
                    .to_string();
                devices.push(Arc::new(lamina_device::striped::Absent::with_reason(
                    name, reason,
                )))
            }
        }
    }
    Ok((devices, cfg.engine_config()?))
}

fn admin_socket(dir: &Path) -> Result<PathBuf> {
    let cfg = Config::load(dir)?;
    Ok(Config::resolve(dir, &cfg.admin_socket))
}

/// Whether the array's cache tier is a mirror (2 or 3 copies).
fn mirrored_cache(st: &lamina_core::StatusReport) -> bool {
    st.cache.as_ref().is_some_and(|c| c.copies > 1)
}

fn array_fail(dir: &Path, device: &str) -> Result<()> {
    let dir = absolute(dir)?;
    // Checked before anything is opened for writing.
    let (st, _) = get_status(&dir)?;
    let mirrored = mirrored_cache(&st);
    if (st.layout == "jbod" && !mirrored) || st.layout == "said0" {
        bail!(
            "a {} array has no redundancy: no member can be failed",
            if st.layout == "jbod" { "JBOD" } else { "SAID0" }
        );
    }
    let device = member_arg(&st, "--device", device)?;
    if st.layout == "jbod" && st.members[device].tier != "cache" {
        bail!(
            "member {device} is in the capacity tier, a JBOD, which has no redundancy: only \
             a copy of the cache mirror can be failed"
        );
    }
    let req = json!({"op": "member-fail", "index": device});
    if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
        offline(&dir, Request::FailMember { index: device })?;
    }
    println!(
        "member {device} of {} is failed; the {} runs degraded",
        dir.display(),
        if mirrored { "cache mirror" } else { "array" }
    );
    Ok(())
}

/// Runs a request against a stopped array (opened read-write, then closed cleanly).
fn offline(dir: &Path, req: Request) -> Result<()> {
    offline_all(dir, [req])
}

/// Opens a stopped array and runs `reqs` on it, one after the other, stopping at
/// the first that fails.
fn offline_all(dir: &Path, reqs: impl IntoIterator<Item = Request>) -> Result<()> {
    let (mut engine, _) = open_array(dir, OpenMode::ReadWrite).context(
        "cannot open the array (if `lamina serve` is running, its admin socket did not answer)",
    )?;
    for req in reqs {
        let token = lamina_core::Token { conn: 0, handle: 1 };
        // Rounds of an hour each: what waits for GC (a rollback that needs free
        // segments) gets its answer rather than none.
        match lamina_core::call_inline(&mut engine, token, req, 64) {
            Some(r) => r.result?,
            None => bail!("request did not complete: garbage collection could not free what it needs in 64 rounds"),
        }
    }
    Ok(())
}

fn volume(cmd: VolumeCmd) -> Result<()> {
    let cmd_kind = match &cmd {
        VolumeCmd::Clone { .. } => "clone",
        _ => "",
    };
    match cmd {
        VolumeCmd::Create { args, size } => {
            let (dir, name) = dir_and_name(args)?;
            let size = size_arg("--size", &size)?;
            let req = json!({"op": "volume-create", "name": name, "size": size});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(
                    &dir,
                    Request::CreateVolume {
                        name: name.clone(),
                        size_bytes: size,
                    },
                )?;
            }
            println!("created volume {name:?} ({})", human(size));
            // Thin provisioning, as LVM says it: promising more than there is works
            // until the space runs out.
            if let Ok((st, _)) = get_status(&dir) {
                if st.promised_bytes > st.usable_bytes {
                    eprintln!(
                        "lamina: warning: the volumes now promise {} = {:.2}x the usable {} \
                         (thin provisioning: writes to unwritten blocks fail with ENOSPC \
                         once it is in use; `lamina status` shows how full it is)",
                        human(st.promised_bytes),
                        st.promised_bytes as f64 / st.usable_bytes.max(1) as f64,
                        human(st.usable_bytes)
                    );
                }
            }
        }
        VolumeCmd::Resize { args, size, force } => {
            use admin::NewSize;
            let (dir, name) = dir_and_name(args)?;
            let target = match (size.strip_prefix('+'), size.strip_prefix('-')) {
                (Some(d), _) => NewSize::Grow(size_arg("--size", d)?),
                (_, Some(d)) => NewSize::Shrink(size_arg("--size", d)?),
                _ => NewSize::Absolute(size_arg("--size", &size)?),
            };
            let cannot = |old: u64| {
                anyhow::anyhow!(
                    "--size {size}: the volume of {} cannot take that",
                    human(old)
                )
            };
            // A running server applies a relative size to the size the volume has
            // when it gets there (two at once both count).
            let (field, n) = match target {
                NewSize::Absolute(n) => ("size", n),
                NewSize::Grow(n) => ("grow", n),
                NewSize::Shrink(n) => ("shrink", n),
            };
            let req = json!({"op": "volume-resize", "name": name, field: n, "force": force});
            let (old, new) = match admin::request(&admin_socket(&dir)?, &req)? {
                Some(v) => (
                    v["old_size"].as_u64().unwrap_or(0),
                    v["size"].as_u64().unwrap_or(0),
                ),
                None => {
                    let (st, _) = get_status(&dir)?;
                    let (old, id) = st
                        .volumes
                        .iter()
                        .find(|v| v.name == name)
                        .map(|v| (v.size_bytes, lamina_core::VolumeId(v.id)))
                        .ok_or_else(|| anyhow::anyhow!("no volume named {name:?}"))?;
                    let new = target.from(old).ok_or_else(|| cannot(old))?;
                    // Checked before a forced shrink trims anything.
                    lamina_core::check_volume_size(new)?;
                    let mut reqs = Vec::new();
                    if force && new < old {
                        reqs.push(lamina_core::trim_tail(id, new, old));
                    }
                    reqs.push(Request::ResizeVolume {
                        name: name.clone(),
                        size_bytes: new,
                    });
                    offline_all(&dir, reqs)?;
                    (old, new)
                }
            };
            println!(
                "resized volume {name:?} from {} to {}",
                human(old),
                human(new)
            );
        }
        VolumeCmd::Rename { mut args } => {
            let new_name = args.pop().expect("clap asks for two or three");
            let (dir, name) = dir_and_name(args)?;
            let req = json!({"op": "volume-rename", "name": name, "new_name": new_name});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(
                    &dir,
                    Request::RenameVolume {
                        name: name.clone(),
                        new_name: new_name.clone(),
                    },
                )?;
            }
            let section = config::rename_volume_section(&Config::path(&dir), &name, &new_name)
                .context("the volume is renamed, but its section in lamina.toml is not")?;
            println!(
                "renamed volume {name:?} to {new_name:?}{}",
                if section {
                    " (and its section in lamina.toml)"
                } else {
                    ""
                }
            );
        }
        VolumeCmd::Snapshot { mut args } | VolumeCmd::Clone { mut args } => {
            let writable = matches!(cmd_kind, "clone");
            let new_name = args.pop().expect("clap asks for two or three");
            let (dir, origin) = dir_and_name(args)?;
            let req = json!({"op": "volume-snapshot", "origin": origin, "name": new_name, "writable": writable});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(
                    &dir,
                    Request::CreateSnapshot {
                        origin: origin.clone(),
                        name: new_name.clone(),
                        writable,
                    },
                )?;
            }
            println!(
                "{} {new_name:?} of volume {origin:?} made",
                if writable { "clone" } else { "snapshot" }
            );
        }
        VolumeCmd::Rollback { mut args, force } => {
            let snapshot = args.pop().expect("clap asks for two or three");
            let (dir, name) = dir_and_name(args)?;
            let req = json!({"op": "volume-rollback", "name": name, "snapshot": snapshot, "force": force});
            let once = || -> Result<()> {
                if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                    offline(
                        &dir,
                        Request::Rollback {
                            name: name.clone(),
                            snapshot: snapshot.clone(),
                        },
                    )?;
                }
                Ok(())
            };
            // The engine refuses a rollback while a checkpoint is being written
            // (a few ms to seconds): try again, for up to a minute.
            let t0 = std::time::Instant::now();
            loop {
                match once() {
                    Err(e)
                        if format!("{e:#}").contains(lamina_core::ROLLBACK_BUSY)
                            && t0.elapsed() < std::time::Duration::from_secs(60) =>
                    {
                        std::thread::sleep(std::time::Duration::from_millis(50));
                    }
                    r => break r?,
                }
            }
            println!("volume {name:?} rolled back to snapshot {snapshot:?}");
        }
        VolumeCmd::Delete { args, force } => {
            let (dir, name) = dir_and_name(args)?;
            let req = json!({"op": "volume-delete", "name": name, "force": force});
            if admin::request(&admin_socket(&dir)?, &req)?.is_none() {
                offline(&dir, Request::DeleteVolume { name: name.clone() })?;
            }
            // Limits `volume qos` saved go with the volume (a new volume of the
            // name starts free, as on a running server); other choices stay.
            config::set_volume_keys(
                &Config::path(&dir),
                &name,
                &[("iops_limit", None), ("bandwidth_limit", None)],
            )
            .context("the volume is deleted, but its limits stay in lamina.toml")?;
            println!("deleted volume {name:?}");
        }
        VolumeCmd::Qos {
            args,
            iops,
            bandwidth,
            live_only,
        } => {
            let (dir, name) = dir_and_name(args)?;
            let mut req = json!({"op": "volume-qos", "name": name});
            // What goes into lamina.toml: the key's TOML value, or None to remove it.
            let mut keys: Vec<(&str, Option<String>)> = Vec::new();
            if let Some(v) = &iops {
                req["iops"] = match v.as_str() {
                    "none" => serde_json::Value::Null,
                    n => match n.parse::<u64>() {
                        Ok(n) if n > 0 => json!(n),
                        _ => {
                            return Err(Usage(format!(
                                "--iops {v}: give a positive number or none"
                            ))
                            .into())
                        }
                    },
                };
                keys.push(("iops_limit", req["iops"].as_u64().map(|n| n.to_string())));
            }
            if let Some(v) = &bandwidth {
                req["bandwidth"] = match v.as_str() {
                    "none" => serde_json::Value::Null,
                    s => match size_arg("--bandwidth", s)? {
                        0 => return Err(Usage("--bandwidth 0: give more, or none".into()).into()),
                        n => json!(n),
                    },
                };
                keys.push((
                    "bandwidth_limit",
                    req["bandwidth"].as_u64().map(|_| format!("{v:?}")),
                ));
            }
            let answer = admin::request(&admin_socket(&dir)?, &req)?;
            if answer.is_none() && (keys.is_empty() || live_only) {
                bail!(
                    "no server is running for {}: live limits need one (without \
                     --live-only, limits given are written to [engine.volumes.{name}] in \
                     its lamina.toml, for every start)",
                    dir.display()
                );
            }
            if answer.is_none() && !get_status(&dir)?.0.volumes.iter().any(|v| v.name == name) {
                bail!("no volume named {name:?}");
            }
            let saved = !keys.is_empty() && !live_only;
            if saved {
                config::set_volume_keys(&Config::path(&dir), &name, &keys)
                    .context("the limits are not saved in lamina.toml")?;
            }
            let limits = match &answer {
                Some(v) => v["limits"].clone(),
                None => json!({"iops": req.get("iops"), "bandwidth": req.get("bandwidth")}),
            };
            let show = |x: &serde_json::Value, f: &dyn Fn(u64) -> String| {
                x.as_u64().map_or("no limit".to_string(), f)
            };
            println!(
                "volume {name:?}: requests {}, bandwidth {}{}",
                show(&limits["iops"], &|n| format!("{n}/s")),
                show(&limits["bandwidth"], &|n| format!("{}/s", human(n))),
                match (saved, answer.is_some()) {
                    (true, true) => " (saved in lamina.toml)",
                    (true, false) => " (saved in lamina.toml: from the next start)",
                    _ => "",
                }
            );
        }
        VolumeCmd::List {
            dir,
            json,
            snapshots,
        } => {
            let dir = absolute(&dir.unwrap_or_else(default_dir))?;
            let (mut report, running) = get_status(&dir)?;
            if snapshots {
                report.volumes.retain(|v| v.snapshot);
            }
            if json {
                let v = output::status_json(&report, running);
                println!("{}", serde_json::to_string_pretty(&v["volumes"])?);
            } else {
                // As `zfs list -o name,used,refer,origin`: LIVE is what the
                // volume maps, EXCLUSIVE what deleting it would free.
                println!(
                    "{:<20} {:>10} {:>12} {:>12} {:<8} ORIGIN",
                    "NAME", "SIZE", "LIVE", "EXCLUSIVE", "TYPE"
                );
                for v in &report.volumes {
                    let kind = match (v.snapshot, &v.origin) {
                        (true, _) => "snapshot",
                        (false, Some(_)) => "clone",
                        (false, None) => "volume",
                    };
                    println!(
                        "{:<20} {:>10} {:>12} {:>12} {:<8} {}",
                        v.name,
                        human(v.size_bytes),
                        human(v.live_bytes),
                        human(v.exclusive_bytes),
                        kind,
                        v.origin.as_deref().unwrap_or("-")
                    );
                }
            }
        }
    }
    Ok(())
}

/// `[DIR] NAME` of the volume commands: DIR defaults to ./lamina-data, as for
/// `serve` and `status`.
fn dir_and_name(mut args: Vec<String>) -> Result<(PathBuf, String)> {
    let name = args.pop().expect("clap requires NAME");
    let dir = args.pop().map_or_else(default_dir, PathBuf::from);
    Ok((absolute(&dir)?, name))
}

fn get_status(dir: &Path) -> Result<(lamina_core::StatusReport, bool)> {
    if let Some(v) = admin::request(&admin_socket(dir)?, &json!({"op": "status"}))? {
        return Ok((admin::status_from_json(&v)?, true));
    }
    let (engine, _) = open_array(dir, OpenMode::ReadOnly).context(
        "cannot read the array (if `lamina serve` is running, its admin socket did not answer)",
    )?;
    let mut report = engine.status();
    lamina_core::status::count_exclusive(engine.shared(), &mut report);
    Ok((report, false))
}

fn status(a: StatusArgs) -> Result<()> {
    let dir = absolute(&a.dir.unwrap_or_else(default_dir))?;
    if a.prometheus {
        // A running server adds its NBD metrics to the array's.
        if let Some(v) = admin::request(&admin_socket(&dir)?, &json!({"op": "metrics"}))? {
            if let Some(text) = v["metrics"].as_str() {
                print!("{text}");
                return Ok(());
            }
        }
    }
    // A running server also knows its last scrub and the volumes' limits.
    let (report, running, raw) =
        match admin::request(&admin_socket(&dir)?, &json!({"op": "status"}))? {
            Some(v) => (admin::status_from_json(&v)?, true, v["status"].clone()),
            None => (get_status(&dir)?.0, false, serde_json::Value::Null),
        };
    let last_scrub = raw["last_scrub"].clone();
    if a.json {
        // The same fields either way: a stopped array has no last scrub or limits.
        let mut v = output::status_json(&report, running);
        v["last_scrub"] = last_scrub;
        v["qos"] = if running {
            raw["qos"].clone()
        } else {
            json!({})
        };
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else if a.prometheus {
        print!("{}", output::metrics_text(&report));
    } else {
        print!("{}", output::status_text(&report, running));
        if running {
            print!("{}", output::scrub_line(&last_scrub));
        }
    }
    Ok(())
}
