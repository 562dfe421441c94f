//! Load balancing for ferry: the load model and the four policies of a dynamic
//! load balancer (Gerofi et al. (DVE) §IV: transfer, location, selection,
//! information), the openMosix variants measured by Meehan & Wynne (openMosix),
//! and a discrete-event simulator ([`sim`]) that runs this same code.
//!
//! Everything here is pure and deterministic: time comes in as an
//! [`Instant`] and randomness as a `&mut dyn RngCore`, both chosen by the
//! caller. ferryd's conductor drives these types with the real clock and
//! real samples; the simulator drives them with a virtual clock and seeded
//! generators, so a simulated result is a result of the code that ships.
//!
//! A node's turn, in the order the conductor runs it:
//! 1. [`load`]: sample the node and its processes, keep the decayed load
//!    and the pessimistic export load;
//! 2. [`information`]: exchange loads with peers (heartbeat broadcast or
//!    hearsay gossip) and keep an approximate view of the cluster;
//! 3. [`balancer::Balancer::plan`]: the [`transfer`] policy says whether this
//!    node should send (or ask for) work, the [`selection`] policy picks
//!    the process, the [`location`] policy ranks destinations;
//! 4. [`transfer::MigrationGate`]: the two-phase commit with the receiver
//!    (offer, accept or refuse, commit or abort) and the calm-down period.

pub mod balancer;
pub mod config;
pub mod error;
pub mod field;
pub mod information;
pub mod load;
pub mod location;
pub mod measured_cost;
pub mod migration_cost;
pub mod node;
pub mod placement;
pub mod selection;
pub mod sim;
pub mod time;
pub mod transfer;

pub use balancer::{Balancer, Plan};
pub use config::Config;
pub use error::PolicyError;
pub use node::{NodeId, PeerLoad, ProcessId};
pub use time::{Clock, Instant};
