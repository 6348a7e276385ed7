//! Resident memory of a process, from `/proc`.

/// VmRSS of process `pid` (`"self"` for this one), in KiB.
pub fn rss_kib(pid: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap()
}

/// Major page faults of process `pid` so far (pages read back from disk), from `/proc/PID/stat`
/// (0 once it is gone).
pub fn major_faults(pid: u32) -> u64 {
    stat_fields(pid).get(9).map_or(0, |&faults| faults as u64)
}

/// The time columns of CPU `cpu`'s line in `/proc/stat`, in seconds (user nice system idle
/// iowait irq softirq steal ...); none when there is no such CPU.
fn cpu_columns(cpu: &str) -> Vec<f64> {
    let stat = std::fs::read_to_string("/proc/stat").unwrap();
    let name = format!("cpu{cpu}");
    let Some(line) = stat
        .lines()
        .find(|l| l.split_whitespace().next() == Some(name.as_str()))
    else {
        return Vec::new();
    };
    line.split_whitespace()
        .skip(1)
        .map(|t| t.parse().unwrap_or(0.0) / 100.0)
        .collect()
}

/// What CPU `cpu` has spent, in seconds, from `/proc/stat`.
#[derive(Debug, Clone, Copy, Default)]
pub struct CpuTime {
    /// Anything but idle and I/O wait.
    pub busy: f64,
    /// Taken by the hypervisor: the virtual CPU did not run.
    pub steal: f64,
}

impl CpuTime {
    pub fn of(cpu: &str) -> CpuTime {
        let columns = cpu_columns(cpu);
        let column = |i: usize| columns.get(i).copied().unwrap_or(f64::NAN);
        CpuTime {
            busy: [0, 1, 2, 5, 6, 7].map(column).iter().sum(),
            steal: column(7),
        }
    }

    pub fn since(self, before: CpuTime) -> CpuTime {
        CpuTime {
            busy: self.busy - before.busy,
            steal: self.steal - before.steal,
        }
    }
}

/// Every process's pid and its folder in `/proc`.
fn pids() -> impl Iterator<Item = (u32, std::path::PathBuf)> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid = entry.file_name().to_string_lossy().parse().ok()?;
            Some((pid, entry.path()))
        })
}

/// Every process's name and CPU seconds so far (user plus system, all its threads and its
/// waited-for children), by pid and start time (so a reused pid is another process).
pub fn process_cpu_seconds() -> std::collections::HashMap<(u32, u64), (String, f64)> {
    let mut found = std::collections::HashMap::new();
    for (pid, path) in pids() {
        let Ok(stat) = std::fs::read_to_string(path.join("stat")) else {
            continue;
        };
        if let Some((name, fields)) = parse_stat(&stat) {
            let field = |i: usize| fields.get(i).copied().unwrap_or(0.0);
            let children = (field(13) + field(14)) / 100.0;
            let started = field(19) as u64;
            found.insert(
                (pid, started),
                (name.to_owned(), seconds(&fields) + children),
            );
        }
    }
    found
}

/// User plus system CPU seconds process `pid` has used, from `/proc/PID/stat` (0 once it is
/// gone).
pub fn cpu_seconds(pid: u32) -> f64 {
    seconds(&stat_fields(pid))
}

/// User plus system seconds from the fields of a `/proc/PID/stat`.
fn seconds(fields: &[f64]) -> f64 {
    let ticks = |i: usize| fields.get(i).copied().unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// The fields of `/proc/PID/stat` after the command name (0: the state), each as a number (0
/// where it is none); none once the process is gone.
fn stat_fields(pid: u32) -> Vec<f64> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| Some(parse_stat(&stat)?.1))
        .unwrap_or_default()
}

/// A `/proc/PID/stat`'s command name (in parentheses, it may hold spaces) and the fields after
/// it.
fn parse_stat(stat: &str) -> Option<(&str, Vec<f64>)> {
    let (open, close) = (stat.find('(')?, stat.rfind(')')?);
    let fields = stat[close + 1..]
        .split_whitespace()
        .map(|field| field.parse().unwrap_or(0.0))
        .collect();
    Some((&stat[open + 1..close], fields))
}

/// The control plane whose folder is `dir`: its etcd, kube-apiserver and
/// kube-controller-manager, by their program's name.
pub fn processes_under(dir: &std::path::Path) -> Vec<(String, u32)> {
    // With the separator: a folder `...-1` must not match `...-10`.
    let dir = format!("{}/", dir.display());
    let mut found = Vec::new();
    for (pid, path) in pids() {
        let Ok(cmdline) = std::fs::read(path.join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline);
        let program = cmdline.split('\0').next().unwrap_or_default();
        let name = program.rsplit('/').next().unwrap_or(program).to_owned();
        // Replicas name the folder too (their kubeconfig): only the control plane's own.
        if cmdline.contains(&dir) && (name == "etcd" || name.starts_with("kube-")) {
            found.push((name, pid));
        }
    }
    found.sort();
    found
}
